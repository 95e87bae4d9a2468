"""The statistics the study report uses: paired intervals over seeds, a paired bootstrap over examples x seeds,
Fisher's exact test for failure counts, and Holm's correction for a family of hypotheses.

The seed is the unit of replication: arms that share a seed share initial weights and data order, so every
comparison here is paired (differences taken within a seed, or within an example and a seed).
"""

from dataclasses import dataclass

import numpy as np
from scipy import stats


@dataclass
class Estimate:
    """A difference with its 95% interval and a one-sided p value for the predicted direction."""

    mean: float
    lo: float
    hi: float
    p: float
    n: int

    def fmt(self, digits: int = 3) -> str:
        f = f"{{:+.{digits}f}}"
        return f"{f.format(self.mean)} [{f.format(self.lo)}, {f.format(self.hi)}]"


def paired_t(diffs, greater: bool = True, conf: float = 0.95) -> Estimate:
    """Mean of paired differences with a t interval; p for H1: mean > 0 (greater) or mean < 0."""
    d = np.asarray(diffs, dtype=float)
    d = d[np.isfinite(d)]
    n = len(d)
    if n < 2:
        m = float(d.mean()) if n else float("nan")
        return Estimate(m, float("nan"), float("nan"), float("nan"), n)
    mean, se = float(d.mean()), float(d.std(ddof=1) / np.sqrt(n))
    half = float(stats.t.ppf(0.5 + conf / 2, n - 1)) * se
    if se == 0:
        p = 0.0 if (mean > 0) == greater and mean != 0 else 1.0
    else:
        t = mean / se
        p = float(stats.t.sf(t, n - 1) if greater else stats.t.cdf(t, n - 1))
    return Estimate(mean, mean - half, mean + half, p, n)


def paired_bootstrap(a, b, greater: bool = True, reps: int = 2000, seed: int = 0, conf: float = 0.95) -> Estimate:
    """Mean of a - b where a, b are (seeds, examples) arrays of per-example scores (e.g. 1 = correct) from paired
    runs. Each resample draws seeds with replacement and, independently, examples with replacement, so both
    sources of variation enter the interval. p: the share of resamples on the wrong side of 0."""
    diff = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)  # (S, N)
    if diff.ndim != 2 or diff.size == 0:  # nothing to pair (an arm missing from a partial study)
        return Estimate(float("nan"), float("nan"), float("nan"), float("nan"), 0)
    s, n = diff.shape
    rng = np.random.default_rng(seed)
    means = np.empty(reps)
    for r in range(reps):
        rows = rng.integers(0, s, s)
        cols = rng.integers(0, n, n)
        means[r] = diff[np.ix_(rows, cols)].mean()
    lo, hi = np.quantile(means, [0.5 - conf / 2, 0.5 + conf / 2])
    wrong = (means <= 0) if greater else (means >= 0)
    return Estimate(float(diff.mean()), float(lo), float(hi), float(wrong.mean()), s * n)


def fisher_greater(fail_a: int, n_a: int, fail_b: int, n_b: int) -> float:
    """One-sided Fisher exact p for H1: arm a fails more often than arm b."""
    table = [[fail_a, n_a - fail_a], [fail_b, n_b - fail_b]]
    return float(stats.fisher_exact(table, alternative="greater")[1])


def holm(pvalues: dict) -> dict:
    """Holm-adjusted p values (step-down, monotone), same keys; NaN p values stay NaN and are not counted."""
    finite = sorted((p, k) for k, p in pvalues.items() if np.isfinite(p))
    m, running, out = len(finite), 0.0, {k: float("nan") for k in pvalues}
    for i, (p, k) in enumerate(finite):
        running = max(running, min(1.0, (m - i) * p))
        out[k] = running
    return out
