"""The one analysis of any study: its records and its spec (spec.py) in, every hypothesis tested out. Per seed and
LR rank each hypothesis is a contrast over arms (a pair, group means, a factorial main effect or interaction, a
rank correlation over arms); exact paired sign-flip test (or the t test where the A/A control allows it), Holm
within each family and rank, each test's floor, a verdict only where both LR ranks agree, the horizon rule for
outcomes read at the end of training, and a scorecard of every prediction (docs/studies.md, "The analysis")."""

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from normlab.run_dir import FINISHED
from normlab.study import outcomes as oc
from normlab.study import rules
from normlab.study.measures import AT_END, MEASURES, load_hooks, measure  # noqa: F401  (hook files: measure)
from normlab.study.records import RunRecord
from normlab.study.seedstats import Paired, holm
from normlab.study.spec import Hypothesis, StudySpec


class Study:
    """One study's finished runs, its LR choices, its extra tables (signal.jsonl ...) and its spec."""

    def __init__(self, runs: list, selection: dict, spec: StudySpec, tables: dict | None = None):
        runs = [r if isinstance(r, RunRecord) else RunRecord.from_dict(r) for r in runs]
        self.runs = [r for r in runs if r.status in FINISHED]
        self.unfinished = [r for r in runs if r.status not in FINISHED]
        self.selection, self.spec, self.tables = selection, spec, tables or {}

    def in_experiment(self, experiment: str, arm: str, warmup: str = "on", lr: float | None = None) -> list:
        rows = [r for r in self.runs if experiment in r.experiments and r.variant == arm and r.warmup == warmup
                and (lr is None or math.isclose(r.lr, lr))]
        return sorted(rows, key=lambda r: (r.lr, r.seed))

    def lr(self, arm: str, rank: int) -> float | None:
        """The arm's LR at this rank (0: its best, 1: its runner-up); None where it has none."""
        if arm in self.spec.pin:
            lrs = self.spec.pin[arm].lrs
            return lrs[rank] if rank < len(lrs) else None
        found = (self.spec.plan.chosen_lr(name, arm, self.selection, rank)
                 for name in self.spec.chosen_lr_experiments(arm))
        return next((lr for lr in found if lr is not None), None)

    def arm(self, arm: str, rank: int) -> list[RunRecord]:
        """The arm's runs at its LR of this rank, one per seed, by seed."""
        lr = self.lr(arm, rank)
        if lr is None:
            return []
        names = self.spec.pin[arm].experiments if arm in self.spec.pin else self.spec.chosen_lr_experiments(arm)
        runs = {r.name: r for n in names for r in self.in_experiment(n, arm, lr=lr)}
        return sorted(runs.values(), key=lambda r: r.seed)

    def per_seed(self, arms, rank: int, outcome: str) -> dict:
        """{seed: the outcome}, averaged over `arms` (a name or a group) at the seeds they share."""
        fn = MEASURES[outcome]
        tables = [{r.seed: fn(r, self) for r in self.arm(a, rank)} for a in ([arms] if isinstance(arms, str)
                                                                              else arms)]
        seeds = set.intersection(*(set(t) for t in tables)) if tables else set()
        return {s: float(np.mean([t[s] for t in tables])) for s in sorted(seeds)}


# ---------------------------------------------------------------------------------------------------------------
# contrasts: one value per seed


def factorial_contrast(cells: dict, table: dict, factors: list) -> float:
    """One seed's contrast over a 2^k design's cells (`table`: cell -> value): one factor, its main effect (level 2
    - level 1, averaged over the other factors' levels); several, their interaction (the difference of the
    lower-order contrast between the last factor's levels, averaged over the factors not named)."""
    names = list(next(iter(cells.values())))
    levels = {f: list(dict.fromkeys(c[f] for c in cells.values())) for f in names}
    rest = [f for f in names if f not in factors]
    total = []
    for fixed in itertools.product(*(levels[f] for f in rest)):
        base = dict(zip(rest, fixed))
        terms = []
        for signs in itertools.product((-1, 1), repeat=len(factors)):
            want = {**base, **{f: levels[f][(s + 1) // 2] for f, s in zip(factors, signs)}}
            cell = next(c for c, lv in cells.items() if lv == want)
            terms.append(math.prod(signs) * table[cell])
        total.append(sum(terms))
    return float(np.mean(total))


def contrast_values(study: Study, h: Hypothesis, rank: int) -> list[float]:
    """The hypothesis's per-seed values at an LR rank (the seeds every arm it reads has)."""
    if h.contrast in ("pair", "group_means"):
        a, b = (study.per_seed(side, rank, h.outcome) for side in (h.a, h.b))
        return [a[s] - b[s] for s in sorted(set(a) & set(b))]
    cells = study.spec.plan.cells
    tables = {c: study.per_seed(c, rank, h.outcome) for c in cells}
    seeds = sorted(set.intersection(*(set(t) for t in tables.values())))
    return [factorial_contrast(cells, {c: t[s] for c, t in tables.items()}, h.factors) for s in seeds]


def largest_lr_values(study: Study, h: Hypothesis) -> list[float]:
    """Per seed, log10 of the largest LR of `h.experiment`'s grid at which arm a learned, minus arm b's (a
    quarter decade below the grid where none did)."""
    grid = sorted({r.lr for r in study.runs if h.experiment in r.experiments})
    out = []
    for arm in (h.a, h.b):
        by_seed = {}
        for r in study.in_experiment(h.experiment, arm, h.warmup):
            by_seed.setdefault(r.seed, {})[r.lr] = oc.run_outcome(r)
        out.append({s: math.log10(oc.largest_learning_lr(o) or min(grid) * 10 ** -0.25) for s, o in by_seed.items()})
    return [out[0][s] - out[1][s] for s in sorted(set(out[0]) & set(out[1]))]


# ---------------------------------------------------------------------------------------------------------------
# tests and verdicts


@dataclass
class Result:
    """One hypothesis tested: per LR rank its estimate, Holm p, floor and verdict; then the verdict over ranks."""

    h: Hypothesis
    est: dict = field(default_factory=dict)  # {rank: Paired}
    nonzero: dict = field(default_factory=dict)
    p: dict = field(default_factory=dict)  # Holm-adjusted within the family, per rank
    floor: dict = field(default_factory=dict)
    verdicts: dict = field(default_factory=dict)
    verdict: str = ""
    horizon: tuple = (None, "")  # (ok or None where the rule does not apply, why not)
    bounds: dict = field(default_factory=dict)  # {rank: [(side, bound, lowest, highest, n runs, met)]}: every_run
    ratios: dict = field(default_factory=dict)  # {rank: (geometric mean of a / b over seeds, seeds, met)}: ratio
    score: str = ""


def single(result: Result, rank: int, alpha: float) -> str:
    est, p, floor = result.est[rank], result.p[rank], result.floor[rank]
    if est.n < 2 or not math.isfinite(est.mean) or not floor < alpha:
        return f"{rules.UNDECIDED} (p >= {floor:.3g})"
    if result.h.sign in (-1, 1):
        return rules.single_verdict(est, p, result.h.sign, alpha)
    return "not separated" if not p < alpha else f"separated ({'+' if est.mean > 0 else '-'})"


def scored(result: Result) -> str:
    """The prediction against the result: held, failed, not shown, undecided (a predicted 'not separated' that
    separated failed, and so does any prediction with a run outside its declared `every_run` bound)."""
    v, sign = result.verdict, result.h.sign
    if v.startswith(rules.UNDECIDED):
        return "undecided"
    if result.horizon[0] is False:
        return "no verdict: horizon too short"
    if any(row[-1] is False for rows in result.bounds.values() for row in rows):
        return "**FAILED**: a run outside its declared bound"
    if any(met is False for _, _, met in result.ratios.values()):
        return f"**FAILED**: the ratio is not {result.h.ratio}"
    if sign is None:
        return "no prediction"
    if v == rules.DEPENDS:
        return "not shown: depends on the LR"
    if sign == 0:
        if v == "not separated" and result.h.within is not None and not all(
                -result.h.within <= e.lo and e.hi <= result.h.within for e in result.est.values()):
            return f"not shown: the interval is wider than +-{result.h.within:g}"
        return "held" if v == "not separated" else "**FAILED**"
    return {"confirmed": "held", "refuted": "**FAILED**"}.get(v, "not shown")


def test_hypotheses(study: Study, test: str) -> list[Result]:
    """Every hypothesis but the rank correlations: estimates per rank, Holm within family and rank, floors,
    verdicts, the horizon rule and the score."""
    spec = study.spec
    results = []
    for h in (h for h in spec.hypotheses if h.contrast != "rank_correlation"):
        r = Result(h)
        ranks = (0,) if h.outcome == "largest_learning_lr" else range(spec.ranks())
        for k in ranks:
            values = largest_lr_values(study, h) if h.outcome == "largest_learning_lr" else \
                contrast_values(study, h, k)
            r.est[k] = rules.estimate(values, test)
            r.nonzero[k] = int(np.count_nonzero(np.abs(np.asarray(values, dtype=float)) > 1e-12))
        results.append(r)
    for k in range(spec.ranks()):
        for family in {r.h.family or r.h.id for r in results}:
            members = [r for r in results if (r.h.family or r.h.id) == family and k in r.est]
            adjusted = holm({r.h.id: r.est[k].p for r in members})
            for r in members:
                r.p[k] = adjusted[r.h.id]
                r.floor[k] = rules.test_floor(r.nonzero[k], len(members)) if test == "permutation" else 0.0
    for r in results:
        r.verdicts = {k: single(r, k, spec.alpha) for k in r.est}
        r.verdict = rules.robust_verdict(r.verdicts)
        r.bounds = {k: bound_rows(study, r.h, k) for k in r.est} if r.h.every_run else {}
        r.ratios = {k: ratio_row(study, r.h, k) for k in r.est} if r.h.ratio else {}
        if r.h.outcome in AT_END:
            r.horizon = horizon(study, spec.arms_of(r.h), AT_END[r.h.outcome])
            if r.horizon[0] is False:
                r.verdict += f"; {rules.HORIZON_TOO_SHORT}"
        r.score = scored(r)
    return results


def bound_rows(study: Study, h: Hypothesis, rank: int) -> list[tuple]:
    """Each declared `every_run` bound at an LR rank: (side, bound, lowest, highest, runs, met), over every run of
    the side's arms at that rank; met is None where the side has no runs there yet (a part-trained study)."""
    rows = []
    for side, bound in h.every_run.items():
        arms = getattr(h, side)
        values = [MEASURES[h.outcome](run, study) for a in ([arms] if isinstance(arms, str) else arms)
                  for run in study.arm(a, rank)]
        lo, hi = (min(values), max(values)) if values else (math.nan, math.nan)
        rows.append((side, bound, lo, hi, len(values), rules.bound_met(values, bound) if values else None))
    return rows


def ratio_row(study: Study, h: Hypothesis, rank: int) -> tuple:
    """A declared `ratio` at an LR rank: (the geometric mean over the shared seeds of a / b, seeds, met); met is
    None where no seed has both (a part-trained study), False where a ratio is not positive (it has no log)."""
    a, b = (study.per_seed(side, rank, h.outcome) for side in (h.a, h.b))
    ratios = [a[s] / b[s] for s in sorted(set(a) & set(b))]
    if not ratios:
        return math.nan, 0, None
    if not all(r > 0 and math.isfinite(r) for r in ratios):
        return math.nan, len(ratios), False
    geo = math.exp(float(np.mean(np.log(ratios))))
    return geo, len(ratios), rules.bound_met([geo], h.ratio)


def horizon(study: Study, arms: list[str], field: str) -> tuple:
    """The horizon rule (rules.horizon) for these arms at every LR rank: (ok, why not)."""
    failed = []
    for k in range(study.spec.ranks()):
        runs = {a: study.arm(a, k) for a in arms}
        if not all(runs.values()):
            return False, f"no runs at the {rules.RANKS[k]} LRs"
        h = rules.horizon(runs, field)
        why = (["ranks swapped"] if not all(v["settled"] for v in h.values()) else []) + \
            (["late exit"] if not all(v["exit_ok"] for v in h.values()) else [])
        failed += [f"{w} at the {rules.RANKS[k]} LRs" for w in why]
    return not failed, "; ".join(failed)


def rank_correlations(study: Study) -> list[dict]:
    """Each rank_correlation hypothesis: Spearman's rho over its arms between the median (over seeds, best LR) of
    its outcome and of the measure it names; exact one-sided p in the predicted direction."""
    rows = []
    for h in (h for h in study.spec.hypotheses if h.contrast == "rank_correlation"):
        x = [float(np.nanmedian(list(study.per_seed(a, 0, h.against).values()) or [math.nan])) for a in h.arms]
        y = [float(np.nanmedian(list(study.per_seed(a, 0, h.outcome).values()) or [math.nan])) for a in h.arms]
        if len(x) < 3 or not all(map(math.isfinite, x + y)):
            rows.append({"h": h, "rho": math.nan, "p": math.nan, "verdict": rules.UNDECIDED, "score": "undecided"})
            continue
        negative = h.sign != 1  # the exact test is one-sided: rho at or below the observed one
        rho, p = rules.spearman_exact(x, y if negative else [-v for v in y])
        verdict = "confirmed" if p < study.spec.alpha else "not separated"
        rows.append({"h": h, "rho": rho if negative else -rho, "p": p, "verdict": verdict,
                     "score": "held" if verdict == "confirmed" else "not shown"})
    return rows


def aa_control(study: Study) -> dict | None:
    """The A/A control: the arm at its best LR on the board's seeds and on its own experiment's disjoint ones;
    the false-positive rate of each test over resamples, and the test the analysis may then use."""
    aa = study.spec.aa
    if aa is None:
        return None
    fn = MEASURES[aa.outcome]
    a = [fn(r, study) for r in study.arm(aa.arm, 0)]
    lr = study.lr(aa.arm, 0) or math.nan
    b = [fn(r, study) for r in study.in_experiment(aa.experiment, aa.copy or aa.arm, lr=lr)]
    if min(len(a), len(b)) < max(aa.resample, 2):
        return {"too_few": (len(a), len(b)), "test": "permutation"}
    fpr = rules.aa_false_positive_rates(a, b, n=aa.resample)
    est = rules.aa_interval(a, b, "t")
    ok = fpr["t"] <= study.spec.alpha and est.lo <= 0 <= est.hi
    test = "t" if ok and study.spec.test == "calibrated" else "permutation"
    return {"fpr": fpr, "estimate": rules.aa_interval(a, b, test), "test": test, "n": (len(a), len(b))}


@dataclass
class Analysis:
    study: Study
    aa: dict | None
    test: str
    results: list
    correlations: list


def analyse(study: Study) -> Analysis:
    aa = aa_control(study)
    test = aa["test"] if aa else "permutation"
    return Analysis(study, aa, test, test_hypotheses(study, test), rank_correlations(study))


def fmt(est: Paired, p: float, floor: float) -> str:
    """estimate [interval] | Holm p (floor): one format for every test."""
    if est.n < 2:
        return f"n={est.n}"
    bounded = math.isfinite(est.lo) and math.isfinite(est.hi)  # the exact test bounds nothing at its floor
    interval = f"[{est.lo:+.3g}, {est.hi:+.3g}]" if bounded else "[no interval at this n]"
    return (f"{est.mean:+.3g} {interval} \\| {p:.3g}"
            + (f" (floor {floor:.3g})" if floor else "") + f", n={est.n}")
