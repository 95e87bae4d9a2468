"""The numbers of study v3's report, from its committed records alone (no model, no training): arms, their
horizon, the A/A calibration, the largest learning LR and LR sensitivity (hypotheses.py turns them into verdicts).
"""

import math

import numpy as np

from normlab.study import outcomes as oc
from normlab.study.grid import FINISHED
from normlab.study.seedstats import false_positive_rate, paired_test

VAL, DEV = "val/sorted/running", "dev/sorted/running"
ALPHA = 0.05
HORIZON_FRACTION = 0.75  # an arm must leave the plateau by this share of its steps (median over seeds)
MAX_NEVER_LEARNED = 0.2  # ... and at most this share of its seeds may never learn
BOARD = ("ln_pre", "ln_post", "custom_ln", "rmsnorm", "dyt", "batchnorm", "masked_batchnorm", "powernorm", "no_norm")
# the board's arms (study variants) whose norm uses batch statistics: arm names, not norms, so the report needs no
# torch; tests/test_study_report.py checks them against model.norms.BATCH_STAT_NORMS
BATCH_STAT = ("batchnorm", "masked_batchnorm", "powernorm")


class Records:
    """One study's per-run records, with the LR each arm was given (selection.json)."""

    def __init__(self, runs: list[dict], selection: dict, e1: list[dict] = ()):
        # a run that never ended (pending, interrupted, crashed) is no outcome of its configuration: left out and
        # counted apart, so that a partly trained study reports what it has
        self.runs = [r for r in runs if r["status"] in FINISHED]
        self.unfinished = [r for r in runs if r["status"] not in FINISHED]
        self.selection, self.e1 = selection, list(e1)

    def arm(self, experiment: str, variant: str, warmup: str = "on", lr: float | None = None) -> list[dict]:
        rows = [r for r in self.runs if experiment in r.get("experiments", [r["experiment"]])
                and r["variant"] == variant and r["warmup"] == warmup and (lr is None or math.isclose(r["lr"], lr))]
        return sorted(rows, key=lambda r: (r["lr"], r["seed"]))

    def lrs(self, *experiments: str) -> list[float]:
        """The LRs the runs of any of these experiments trained at, sorted."""
        return sorted({r["lr"] for r in self.runs if set(experiments) & set(r.get("experiments", [r["experiment"]]))})

    def chosen_lr(self, variant: str, warmup: str = "on") -> float | None:
        return (self.selection.get(f"tune/{variant}/wu{warmup}") or {}).get("lr")


def value(run: dict, field: str = "accuracy", key: str = VAL) -> float:
    return run.get("scores", {}).get(key, {}).get(field, float("nan"))


def outcome_of(run: dict) -> str:
    return oc.outcome(run.get("curves", {}).get("loss", []), run["status"])


def by_seed(runs: list[dict], fn) -> dict:
    return {r["seed"]: fn(r) for r in runs}


def paired(a: dict, b: dict) -> list[float]:
    return [a[s] - b[s] for s in sorted(set(a) & set(b))]


def arm_summary(runs: list[dict]) -> dict:
    """Accuracy, loss, outcomes and plateau exits of one arm's runs (one per seed)."""
    outcomes = [outcome_of(r) for r in runs]
    exits = [oc.plateau_exit_step(r.get("curves", {}).get("step", []), r.get("curves", {}).get("loss", []))
             for r in runs]
    steps = max((r["curves"]["step"][-1] for r in runs if r.get("curves", {}).get("step")), default=0)
    acc = np.array([value(r) for r in runs])
    learned_exits = [e for e in exits if e is not None]
    return {"n": len(runs), "accuracy": acc, "loss": np.array([value(r, "loss") for r in runs]),
            "outcomes": {o: outcomes.count(o) for o in oc.OUTCOMES}, "exits": exits, "steps": steps,
            "median_exit": float(np.median(learned_exits)) if learned_exits else None,
            "horizon_ok": horizon_ok(exits, outcomes, steps)}


def horizon_ok(exits: list, outcomes: list[str], steps: int) -> bool:
    """The horizon rule: the arm left the plateau early enough, and few of its seeds never learned."""
    if not exits or not steps:
        return False
    never = outcomes.count(oc.NEVER_LEARNED) / len(outcomes)
    ex = [e if e is not None else math.inf for e in exits]
    return never <= MAX_NEVER_LEARNED and float(np.median(ex)) <= HORIZON_FRACTION * steps


def leaderboard(rec: Records) -> list[dict]:
    rows = []
    for variant in BOARD:
        runs = rec.arm("leaderboard", variant)
        if runs:
            rows.append({"variant": variant, "lr": rec.chosen_lr(variant), **arm_summary(runs)})
    return rows


def aa_calibration(rec: Records, test: str = "t") -> dict:
    """The A/A control: `test` is trusted only if it holds its false-positive rate on it (else: permutation)."""
    diffs = paired(by_seed(rec.arm("aa", "custom_ln_aa"), value), by_seed(rec.arm("leaderboard", "ln_pre"), value))
    est = paired_test(diffs, test)
    fpr = {t: false_positive_rate(diffs, n_seeds=len(diffs), test=t, reps=1000) for t in ("t", "permutation")}
    ok = fpr[test] <= ALPHA and not (est.lo > 0 or est.hi < 0)
    return {"diffs": diffs, "estimate": est, "fpr": fpr, "ok": ok, "test": test if ok else "permutation"}


def largest_lr_by_seed(rec: Records, variant: str, warmup: str, experiment: str = "placement") -> dict:
    """{seed: log10 of the largest grid LR at which the seed learned}; a quarter decade below the grid if none."""
    grid = rec.lrs(experiment)
    runs, out = rec.arm(experiment, variant, warmup), {}
    for seed in sorted({r["seed"] for r in runs}):
        lr = oc.largest_learning_lr({r["lr"]: outcome_of(r) for r in runs if r["seed"] == seed})
        out[seed] = math.log10(lr) if lr else math.log10(min(grid)) - 0.25
    return out


def sensitivity_diffs(rec: Records, a: str, b: str, warmup: str = "off", experiment: str = "placement") -> list:
    """Per seed, LR sensitivity of arm a minus arm b over the experiment's grid, with one shared reference L*."""
    runs = {v: rec.arm(experiment, v, warmup) for v in (a, b)}
    losses = [value(r, "loss") for v in runs.values() for r in v]
    reference = min((x for x in losses if math.isfinite(x)), default=math.log(2))
    sens = {}
    for v, rows in runs.items():
        sens[v] = {s: oc.lr_sensitivity({r["lr"]: value(r, "loss") if r["status"] == "completed" else math.inf
                                         for r in rows if r["seed"] == s}, reference)
                   for s in {r["seed"] for r in rows}}
    return paired(sens[a], sens[b])


def outcome_grid(rec: Records, experiment: str) -> list[dict]:
    """Per (variant, warmup, lr): how many seeds learned, never learned, diverged."""
    rows = []
    keys = sorted({(r["variant"], r["warmup"]) for r in rec.runs if experiment in r.get("experiments", [])})
    for variant, warmup in keys:
        for lr in rec.lrs(experiment):
            outs = [outcome_of(r) for r in rec.arm(experiment, variant, warmup, lr)]
            if outs:
                rows.append({"variant": variant, "warmup": warmup, "lr": lr, "n": len(outs),
                             **{o: outs.count(o) for o in oc.OUTCOMES}})
    return rows
