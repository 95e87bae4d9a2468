"""What a training run ended as, read from its per-step train loss: learned, never left the ln 2 plateau (a binary
classifier's start), or diverged; and the step at which it left the plateau (docs/studies.md, "Outcomes apart"),
both read from the moving mean of the loss over a fixed number of training examples.
"""

import math
from collections.abc import Mapping, Sequence

import numpy as np

PLATEAU = math.log(2)
MARGIN = 0.05  # "clearly below ln 2": the moving-mean train loss under 0.643
# The moving mean covers 640 training examples, 20 steps of 32: single batches are too noisy to read a level from,
# and at a smaller batch 20 steps are noisier still (at batch 8 noise alone made learned runs read "diverged").
WINDOW_EXAMPLES = 640
WINDOW = 20  # steps, for a record that does not say its examples per step (every one written before it did)

LEARNED, NEVER_LEARNED, DIVERGED = "learned", "never learned", "diverged"
RUN_OUTCOMES = (LEARNED, NEVER_LEARNED, DIVERGED)


def smooth(losses: Sequence[float], window: int = WINDOW) -> np.ndarray:
    """Trailing moving mean (the first window-1 values average what exists so far)."""
    x = np.asarray(losses, dtype=float)
    csum = np.cumsum(np.insert(x, 0, 0.0))
    idx = np.arange(1, len(x) + 1)
    lo = np.maximum(0, idx - window)
    return (csum[idx] - csum[lo]) / (idx - lo)


def plateau_exit_step(steps: Sequence[int], losses: Sequence[float], plateau: float = PLATEAU,
                      margin: float = MARGIN, window: int = WINDOW) -> int | None:
    """The first step at which the moving-mean train loss is below plateau - margin; None if it never is."""
    n = next((i for i, x in enumerate(losses) if not math.isfinite(x)), len(losses))  # up to a blow-up
    if n < window:
        return None
    below = np.nonzero(smooth(losses[:n], window)[window - 1:] < plateau - margin)[0]
    return int(steps[below[0] + window - 1]) if below.size else None


def outcome(losses: Sequence[float], status: str = "completed", plateau: float = PLATEAU, margin: float = MARGIN,
            window: int = WINDOW) -> str:
    """diverged: a non-finite loss (or the run stopped as diverged), or it learned and then its moving-mean loss
    climbed back more than halfway to the plateau; never learned: the moving mean never went clearly below the
    plateau; learned: otherwise."""
    if status == "diverged" or not losses or not all(map(math.isfinite, losses)):
        return DIVERGED
    curve = smooth(losses, window)[min(window, len(losses)) - 1:]
    best = float(curve.min())
    if best > plateau - margin:
        return NEVER_LEARNED
    if curve[-1] > best + 0.5 * (plateau - best):
        return DIVERGED
    return LEARNED


def run_window(run) -> int:
    """Steps in a run's (RunRecord's) moving mean: WINDOW_EXAMPLES at its examples per optimizer step."""
    per_step = run.examples_per_step
    return max(1, round(WINDOW_EXAMPLES / per_step)) if per_step else WINDOW


def run_outcome(run) -> str:
    """outcome() of a run (RunRecord), over its own window."""
    return outcome(run.curves.get("loss", []), run.status, window=run_window(run))


def run_exit(run) -> int | None:
    """plateau_exit_step() of a run (RunRecord), over its own window."""
    return plateau_exit_step(run.curves.get("step", []), run.curves.get("loss", []), window=run_window(run))


def exit_or_end(run) -> float:
    """A run's (RunRecord's) plateau exit step; a run that never left the plateau enters as its length."""
    e = run_exit(run)
    return float(e if e is not None else (run.curves.get("step") or [math.nan])[-1])


def largest_learning_lr(outcome_by_lr: Mapping[float, str]) -> float | None:
    """The largest LR of the grid at which the run learned (None: at none). One number per seed, so that two
    placements can be compared paired over seeds."""
    learned = [lr for lr, o in outcome_by_lr.items() if o == LEARNED]
    return max(learned) if learned else None
