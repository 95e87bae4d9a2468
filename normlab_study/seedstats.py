"""Seed-level statistics for the study: the seed is the unit of replication.

Arms that share a seed share initial weights and data order, so a comparison is a list of per-seed differences
d_1..d_n (one number per seed, e.g. a difference in validation accuracy) and every test here takes that list.
Resampling examples as well as seeds (v2's bootstrap) treats the validation sentences as if they were new
training runs: at a handful of seeds it gives intervals that are too narrow. `false_positive_rate` checks a test on
the A/A control (two arms that are the same model) before the test is trusted with anything else.
"""

import itertools
from dataclasses import dataclass

import numpy as np
from scipy import stats

TESTS = ("t", "wilcoxon", "permutation")


@dataclass
class Paired:
    """Mean per-seed difference, its 95% t interval, a two-sided p value, and n seeds."""

    mean: float
    lo: float
    hi: float
    p: float
    n: int
    test: str

    def fmt(self, digits: int = 3) -> str:
        f = f"{{:+.{digits}f}}"
        return f"{f.format(self.mean)} [{f.format(self.lo)}, {f.format(self.hi)}] (p={self.p:.3g}, n={self.n}, {self.test})"


def _clean(diffs) -> np.ndarray:
    d = np.asarray(diffs, dtype=float)
    return d[np.isfinite(d)]


def t_interval(d: np.ndarray, conf: float = 0.95) -> tuple[float, float]:
    if len(d) < 2:
        return float("nan"), float("nan")
    half = float(stats.t.ppf(0.5 + conf / 2, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d)))
    return float(d.mean()) - half, float(d.mean()) + half


def sign_flip_p(d: np.ndarray, reps: int = 20000, seed: int = 0) -> float:
    """Two-sided permutation p of mean(d) = 0: under the null each seed's difference is as likely to have the
    other sign. Exact (all 2^n sign patterns) up to 16 seeds, Monte Carlo beyond."""
    n = len(d)
    observed = abs(d.sum())
    if n <= 16:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=n)))
    else:
        signs = np.random.default_rng(seed).choice((1.0, -1.0), size=(reps, n))
    return float(np.mean(np.abs(signs @ d) >= observed - 1e-12))


def paired_test(diffs, test: str = "t") -> Paired:
    """Paired comparison over seeds with the named test ("t", "wilcoxon" or "permutation")."""
    if test not in TESTS:
        raise ValueError(f"unknown test {test!r}; choose one of {', '.join(TESTS)}")
    d = _clean(diffs)
    lo, hi = t_interval(d)
    mean = float(d.mean()) if len(d) else float("nan")
    if len(d) < 2 or not np.any(d):
        p = float("nan") if len(d) < 2 else 1.0
    elif test == "t":
        p = float(stats.ttest_1samp(d, 0.0).pvalue)
    elif test == "wilcoxon":
        p = float(stats.wilcoxon(d).pvalue)
    else:
        p = sign_flip_p(d)
    return Paired(mean, lo, hi, p, len(d), test)


def false_positive_rate(aa_diffs, n_seeds: int, test: str = "t", alpha: float = 0.05, reps: int = 2000,
                        seed: int = 0) -> float:
    """How often `test` calls the A/A control significant at `alpha` with n_seeds seeds.

    The A/A arms are the same model, so their per-seed differences are noise around 0: centred, each is as likely
    with either sign. With exactly n_seeds differences, every sign pattern of them is one replicate (exact up to
    12 seeds, `reps` random patterns beyond). With a larger pool (e.g. several LRs), each replicate draws n_seeds of
    them with replacement and random signs. Drawing n_seeds from only n_seeds values with replacement would repeat
    values and shrink their spread: that resampling is itself anti-conservative at 10 seeds."""
    d = _clean(aa_diffs)
    if len(d) < 2:
        return float("nan")
    d = d - d.mean()
    rng = np.random.default_rng(seed)
    if len(d) == n_seeds:
        if n_seeds <= 12:
            samples = np.array(list(itertools.product((1.0, -1.0), repeat=n_seeds))) * d
        else:
            samples = rng.choice((1.0, -1.0), size=(reps, n_seeds)) * d
    else:
        samples = rng.choice(d, size=(reps, n_seeds), replace=True) * rng.choice((1.0, -1.0), size=(reps, n_seeds))
    return float(np.mean([paired_test(sample, test).p < alpha for sample in samples]))


def seeds_needed(sd_diff: float, effect: float, alpha: float = 0.05, power: float = 0.8) -> int:
    """Seeds for a two-sided paired t test to detect `effect` with `power`, given the SD of per-seed differences
    (iterated: the t quantiles depend on n)."""
    n = 2
    while n < 1000:
        df = n - 1
        needed = ((stats.t.ppf(1 - alpha / 2, df) + stats.t.ppf(power, df)) * sd_diff / effect) ** 2
        if n >= needed:
            return n
        n += 1
    return n


def binomial_interval(k: int, n: int, conf: float = 0.95) -> tuple[float, float]:
    """Clopper-Pearson interval of a proportion k/n (e.g. the share of seeds that learn at one LR)."""
    if n == 0:
        return float("nan"), float("nan")
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=conf, method="exact")
    return float(ci.low), float(ci.high)


def holm(pvalues: dict) -> dict:
    """Holm-adjusted p values (step-down, monotone), same keys; NaN p values stay NaN and are not counted."""
    finite = sorted((p, k) for k, p in pvalues.items() if np.isfinite(p))
    m, running, out = len(finite), 0.0, {k: float("nan") for k in pvalues}
    for i, (p, k) in enumerate(finite):
        running = max(running, min(1.0, (m - i) * p))
        out[k] = running
    return out
