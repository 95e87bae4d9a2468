"""The decision rules every study is analysed by, as code a report cannot bend (first declared in
docs/study-v4/predictions.md): the smallest p a planned test can reach and its power, the LR choice (best and
runner-up, near ties flagged), the robustness rule (a claim must hold at both LRs), the horizon rule (an arm must
have left the plateau early and the ranking must have settled), and the A/A control on two disjoint seed sets
(docs/studies.md, "The analysis").
"""

import itertools
import math
import operator
import re
from dataclasses import dataclass

import numpy as np
from scipy import stats

from normlab.study import outcomes as oc
from normlab.study.seedstats import Paired, paired_test, sign_flip_p

ALPHA = 0.05
HORIZON_FRACTION = 1 / 3  # an arm's median plateau exit must lie within the first third of its steps
DEPENDS = "depends on the LR"
HORIZON_TOO_SHORT = "horizon too short"
UNDECIDED = "too few seeds to decide"  # the test's smallest attainable p (its floor, after Holm) is not below alpha
RANKS = ("best", "runner-up")  # the two LRs every primary arm trains at


class PlanError(ValueError):
    pass


# ---------------------------------------------------------------------------------------------------------------
# what a planned test can decide


def test_floor(nonzero: int, family: int = 1) -> float:
    """The smallest p an exact sign-flip or Wilcoxon signed-rank test can give with `nonzero` non-zero paired
    differences, two-sided: all of one sign is 2 of the 2^k equally likely sign patterns, p = 2^(1-k). After Holm
    over `family` tests the smallest p is multiplied by the family size (its first step), so the floor is
    family x 2^(1-k)."""
    if nonzero < 1:
        return 1.0
    return min(1.0, family * 2.0 ** (1 - nonzero))


def power(effect: float, sd: float, n: int, alpha: float = ALPHA) -> float:
    """Power of the two-sided paired t test at level `alpha` to detect a mean per-seed difference `effect` when
    the differences have SD `sd`, with n seeds: exact for normal differences (noncentral t). The plan's floor, not
    this, says whether the exact sign-flip test can decide at all."""
    if sd <= 0 or n < 2:
        return float("nan")
    df, nc = n - 1, effect / sd * math.sqrt(n)
    crit = stats.t.ppf(1 - alpha / 2, df)
    return float(stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc))


@dataclass
class PlannedTest:
    """One test of the plan: its seeds (paired differences), how many of them can be non-zero (fewer on a coarse
    grid, where ties are dropped), the Holm family it is corrected in, and the declared effect and per-seed SD."""

    id: str
    seeds: int
    family: int = 1
    nonzero: int | None = None
    effect: float | None = None
    sd: float | None = None
    alpha: float = ALPHA
    smallest_p: float | None = None  # a test that is no sign test (a rank correlation's one ordering of n!)

    def floor(self) -> float:
        if self.smallest_p is not None:
            return min(1.0, self.family * self.smallest_p)
        return test_floor(self.nonzero if self.nonzero is not None else self.seeds, self.family)

    def power(self) -> float:
        """At alpha / family (Holm's first step, the strictest): a lower bound on the corrected power."""
        if self.effect is None or self.sd is None:
            return float("nan")
        return power(self.effect, self.sd, self.seeds, self.alpha / self.family)


def check_plan(tests: list[PlannedTest], refuse: bool = True) -> list[dict]:
    """Every planned test's floor and power; a test whose floor after correction is not below its alpha could
    never decide, whatever the data: refused (PlanError naming each one) unless `refuse` is off (a pilot)."""
    rows = [{"id": t.id, "seeds": t.seeds, "family": t.family, "floor": t.floor(), "power": t.power()} for t in tests]
    refused = [f"{r['id']} (floor {r['floor']:.3g} with {t.nonzero or t.seeds} non-zero pairs in a family of "
               f"{t.family})" for r, t in zip(rows, tests) if not r["floor"] < t.alpha]
    if refused and refuse:
        raise PlanError(f"tests that can never reach alpha: {'; '.join(refused)}; add seeds or shrink the family")
    return rows


# ---------------------------------------------------------------------------------------------------------------
# estimates whose interval and p come from one method


def sign_flip_interval(d, conf: float = 0.95) -> tuple[float, float]:
    """The interval of shifts delta that the sign-flip test of mean(d - delta) = 0 does not reject at 1 - conf
    (the test inverted, found by bisection on each side); infinite when no shift can be rejected (the floor)."""
    d = np.asarray(d, dtype=float)
    alpha = 1 - conf
    if len(d) < 2 or test_floor(len(d)) >= alpha:
        return -math.inf, math.inf
    mean, span = float(d.mean()), float(np.ptp(d)) + 1e-12

    def edge(outside: float) -> float:
        inside = mean  # p(mean) = 1: not rejected
        for _ in range(50):
            mid = (inside + outside) / 2
            if sign_flip_p(d - mid) < alpha:
                outside = mid
            else:
                inside = mid
        return inside

    return edge(mean - 2 * span), edge(mean + 2 * span)


def estimate(diffs, test: str) -> Paired:
    """paired_test's p with an interval from the same method: a t interval for the t test, the inverted
    sign-flip test for the permutation test (v3 printed t intervals beside permutation p values)."""
    est = paired_test(diffs, test)
    if test == "permutation":
        d = np.asarray(diffs, dtype=float)
        est.lo, est.hi = sign_flip_interval(d[np.isfinite(d)])
    return est


# ---------------------------------------------------------------------------------------------------------------
# the LR choice


def choose_lrs(dev_loss_by_lr: dict) -> dict:
    """{lr: [dev loss per sweep seed]} -> the best and runner-up LRs (lowest mean dev loss; a diverged run is
    inf; ties go to the smaller LR), the gap between their means, the per-seed SD (pooled over the two LRs) and
    `near_tie`: the gap is within one per-seed SD, so the sweep's seeds could not tell the two apart. One LR: it
    alone, {"lr": lr}."""
    mean = {float(lr): float(np.mean(v)) for lr, v in dev_loss_by_lr.items()}
    order = sorted(sorted(mean), key=lambda lr: mean[lr])
    if len(order) < 2:
        return {"lr": order[0]}
    best, second = order[0], order[1]
    gap = mean[second] - mean[best]
    pair = [np.asarray(dev_loss_by_lr[lr], dtype=float) for lr in (best, second)]
    finite = all(np.isfinite(x).all() and len(x) > 1 for x in pair)
    sd = float(np.sqrt(np.mean([x.var(ddof=1) for x in pair]))) if finite else math.nan
    return {"lr": best, "runner_up": second, "gap": gap, "seed_sd": sd, "near_tie": bool(finite and gap <= sd)}


# ---------------------------------------------------------------------------------------------------------------
# the robustness rule


def single_verdict(est: Paired, p: float, sign: int, alpha: float = ALPHA) -> str:
    """confirmed / refuted (significant in / against the predicted sign) / not separated."""
    if est.n < 2 or not math.isfinite(est.mean) or not math.isfinite(p):
        return "no data"
    if not p < alpha:
        return "not separated"
    return "confirmed" if np.sign(est.mean) == sign else "refuted"


def robust_verdict(verdicts: dict) -> str:
    """{LR rank: its verdict} for the claim's comparison with every arm at its best LR (rank 0) and every arm at
    its runner-up (rank 1) -> the claim's verdict: it stands only where the ranks agree in direction and
    significance; where a rank could not decide, neither can the claim; otherwise it depends on the LR."""
    undecided = [v for v in verdicts.values() if v.startswith(UNDECIDED)]
    if undecided:
        return max(undecided)
    each = set(verdicts.values())
    return each.pop() if len(each) == 1 else DEPENDS


# ---------------------------------------------------------------------------------------------------------------
# a declared bound on every run (the number that decides a manipulation check)

BOUND_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}


def parse_bound(text) -> tuple[str, float]:
    """'>= 0.55' or '>=0.55' -> ('>=', 0.55); ValueError in one line naming the form where it is not one."""
    op, number = re.fullmatch(r"\s*([<>]=?)?\s*(.*?)\s*", str(text)).groups()
    try:
        if op in BOUND_OPS and math.isfinite(float(number)):  # a NaN bound is met by nothing, inf by everything
            return op, float(number)
    except ValueError:
        pass
    raise ValueError(f"{text!r} is not a bound; write OP NUMBER, OP one of {', '.join(BOUND_OPS)} (e.g. '>= 0.55')")


def bound_met(values: list, bound: str) -> bool:
    """Every value meets the bound (a NaN never does: a run without the number cannot show it)."""
    op, limit = parse_bound(bound)
    return bool(values) and all(BOUND_OPS[op](v, limit) for v in values)


# ---------------------------------------------------------------------------------------------------------------
# the horizon rule


def median_exit(runs: list) -> float:
    """The arm's median plateau-exit step over seeds (a seed that never left the plateau counts as infinite)."""
    exits = [oc.run_exit(r) for r in runs]
    return float(np.median([math.inf if e is None else e for e in exits])) if exits else math.inf


def eval_means(runs: list, field: str = "accuracy") -> dict:
    """{eval step: mean over seeds of the logged evaluation's field}, at the steps every run (RunRecord) evaluated."""
    per_run = [r.evals(field) for r in runs]
    steps = set.intersection(*(set(p) for p in per_run)) if per_run else set()
    return {s: float(np.mean([p[s] for p in per_run])) for s in sorted(steps)}


def examples_per_step(runs: list) -> int:
    """An arm's training examples per optimizer step (its runs share the batch), the unit that puts arms of
    different batch sizes on one axis; 1 where the records do not say (every arm is then read in steps, as
    before records carried it)."""
    return next((r.examples_per_step for r in runs if r.examples_per_step), 1)


def ranking_settled(arms: dict, field: str = "accuracy") -> dict:
    """{arm: its rank among `arms` ({name: runs}) is the same at the last two evaluations they share}. Higher
    accuracy ranks first (for `loss`, lower). Evaluations are matched by the examples trained on, not the step: a
    run at batch 8 evaluated at step 256 has seen what one at batch 32 has at step 64."""
    means = {a: {s * examples_per_step(runs): v for s, v in eval_means(runs, field).items()}
             for a, runs in arms.items()}
    shared = sorted(set.intersection(*(set(m) for m in means.values()))) if means else []
    if len(shared) < 2:
        return {a: False for a in arms}
    sign = 1 if field == "loss" else -1

    def ranks(step):
        order = sorted(arms, key=lambda a: (sign * means[a][step], a))
        return {a: i for i, a in enumerate(order)}

    before, last = ranks(shared[-2]), ranks(shared[-1])
    return {a: before[a] == last[a] for a in arms}


def horizon(arms: dict, field: str = "accuracy") -> dict:
    """{arm: {median_exit, exit_ok, settled, ok}} for the arms a claim compares: ok = the median plateau exit lies
    within the first third of the run and the arms' ranking does not change over the last two evaluations. The run's
    length and each exit are counted in examples (`examples_per_step`), so that an arm at batch 8 (4x the steps) is
    held to the same third of the data as one at batch 32; median_exit stays the arm's own step. An arm that fails
    gets HORIZON_TOO_SHORT, not a verdict."""
    settled = ranking_settled(arms, field)
    span = max((r.steps * examples_per_step(runs) for runs in arms.values() for r in runs), default=0)
    out = {}
    for arm, runs in arms.items():
        m = median_exit(runs)
        out[arm] = {"median_exit": m, "exit_ok": m * examples_per_step(runs) <= HORIZON_FRACTION * span,
                    "settled": settled[arm]}
        out[arm]["ok"] = out[arm]["exit_ok"] and out[arm]["settled"]
    return out


def spearman_exact(x, y) -> tuple[float, float]:
    """(Spearman's rho between x and y, one-sided p of rho <= observed under exchangeability): exact, over every
    ordering of y (up to 8 values: 40,320 orderings). M1 of predictions.md correlates one number per arm."""
    rx, ry = stats.rankdata(x), stats.rankdata(y)
    if len(rx) > 8:
        raise ValueError(f"spearman_exact enumerates n! orderings; {len(rx)} values is too many (at most 8)")
    rho = float(np.corrcoef(rx, ry)[0, 1])
    perms = np.array(list(itertools.permutations(ry)))
    rx_c, ry_c = rx - rx.mean(), perms - perms.mean(axis=1, keepdims=True)
    null = ry_c @ rx_c / np.sqrt((rx_c ** 2).sum() * (ry_c ** 2).sum(axis=1))
    return rho, float(np.mean(null <= rho + 1e-12))


# ---------------------------------------------------------------------------------------------------------------
# the A/A control


def aa_false_positive_rates(a, b, n: int, tests=("t", "permutation"), alpha: float = ALPHA, reps: int = 1000,
                            seed: int = 0) -> dict:
    """The same arm trained on two disjoint seed sets (`a`, `b`: one value per seed): every difference between
    them is noise. Each replicate draws n seeds from each set without replacement and pairs them in the drawn
    order; -> {test: share of replicates the test calls significant at alpha} (<= alpha for a test to trust)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if not (2 <= n <= min(len(a), len(b))):
        raise ValueError(f"n={n} seeds per replicate must be between 2 and the smaller seed set "
                         f"({min(len(a), len(b))})")
    rng = np.random.default_rng(seed)
    diffs = [rng.choice(a, n, replace=False) - rng.choice(b, n, replace=False) for _ in range(reps)]
    return {t: float(np.mean([paired_test(d, t).p < alpha for d in diffs])) for t in tests}


def aa_interval(a, b, test: str = "t") -> Paired:
    """The A/A difference itself, seed i of one set against seed i of the other, interval and p by one method."""
    n = min(len(a), len(b))
    return estimate(np.asarray(a[:n], dtype=float) - np.asarray(b[:n], dtype=float), test)

