"""Seed-level statistics for the study: the seed is the unit of replication, so every test takes a list of per-seed
differences (docs/studies.md, "The seed is the unit" and "Calibrated first").
"""

import itertools
from dataclasses import dataclass

import numpy as np
from scipy import stats

TESTS = ("t", "permutation")  # a spec's `calibrated` is the t test, where the A/A control allows it


@dataclass
class Paired:
    """Mean per-seed difference, its 95% t interval, a two-sided p value, and n seeds."""

    mean: float
    lo: float
    hi: float
    p: float
    n: int
    test: str


def t_interval(d: np.ndarray, conf: float = 0.95) -> tuple[float, float]:
    if len(d) < 2:
        return float("nan"), float("nan")
    half = float(stats.t.ppf(0.5 + conf / 2, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d)))
    return float(d.mean()) - half, float(d.mean()) + half


def sign_flip_p(d: np.ndarray, reps: int = 20000, seed: int = 0) -> float:
    """Two-sided permutation p of mean(d) = 0: under the null each seed's difference is as likely to have the
    other sign. Exact up to 16 seeds (never below 2 / 2**n), Monte Carlo beyond (the observed signs counted among
    the draws, so never 0)."""
    d = np.asarray(d, dtype=float)
    if len(d) <= 16:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=len(d))))  # every pattern; the first: all +1
    else:
        draws = np.random.default_rng(seed).choice((1.0, -1.0), size=(reps, len(d)))
        signs = np.vstack([np.ones(len(d)), draws])
    # the observed sum is read from the same product as the others: summed in another order (d.sum()) it can
    # differ in its last bits, and at tokens/s scales (1e4) by more than the tolerance that counts exact ties
    stats = np.abs(signs @ d)
    return float(np.mean(stats >= stats[0] - 1e-12))


def paired_test(diffs, test: str = "t") -> Paired:
    """Paired comparison over seeds with the named test ("t" or "permutation")."""
    if test not in TESTS:
        raise ValueError(f"unknown test {test!r}; choose one of {', '.join(TESTS)}")
    d = np.asarray(diffs, dtype=float)
    d = d[np.isfinite(d)]
    lo, hi = t_interval(d)
    mean = float(d.mean()) if len(d) else float("nan")
    if len(d) < 2 or not np.any(d):
        p = float("nan") if len(d) < 2 else 1.0
    elif test == "t":
        p = float(stats.ttest_1samp(d, 0.0).pvalue)
    else:
        p = sign_flip_p(d)
    return Paired(mean, lo, hi, p, len(d), test)


def holm(pvalues: dict) -> dict:
    """Holm-adjusted p values (step-down, monotone), same keys; NaN p values stay NaN and are not counted."""
    finite = sorted((p, k) for k, p in pvalues.items() if np.isfinite(p))
    m, running, out = len(finite), 0.0, {k: float("nan") for k in pvalues}
    for i, (p, k) in enumerate(finite):
        running = max(running, min(1.0, (m - i) * p))
        out[k] = running
    return out
