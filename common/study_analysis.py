"""The numbers of the study report, computed from the compact records alone (runs.jsonl, e1.jsonl, labels.json):
no run directory, no model, no training. Every hypothesis of docs/study-v2/predictions.md is one function here
returning its estimate; `verdicts` applies Holm's correction to the primary ones and names each outcome.
"""

import math
from pathlib import Path

import numpy as np

from common.io import read_json, read_jsonl
from common.stability import lr_sensitivity
from common.stats import Estimate, fisher_greater, holm, paired_bootstrap, paired_t
from model.norms import BATCH_STAT_NORMS

VAL, DEV = "val/sorted/running", "dev/sorted/running"
FAIL_ACCURACY = 0.55  # below this a run learned nothing useful (the majority class of validation is 0.509)
ALPHA = 0.05
PRIMARY = ("P1", "P2", "P3", "P4", "P5", "P6", "P7")
# The predictions of docs/study-v2/predictions.md, one line each, by experiment (the report quotes them).
PREDICTIONS = {
    "E1": {"P1": "at init, post-LN's gradients are larger near the output than pre-LN's (Xiong et al. 2020)",
           "S1": "pre-LN's per-block gradient norms stay the same across layers (Xiong et al. 2020)",
           "P2": "post-LN's early model update is larger than DeepNorm's at depth 48 (Wang et al. 2022)",
           "S2": "post-LN's 10-step output change grows with depth, DeepNorm's less (Wang et al. 2022)"},
    "E2": {"P3": "without warmup post-LN fails at high LRs where pre-LN does not (Xiong 2020; Wortsman 2023)",
           "P4": "post-LN is more LR-sensitive than pre-LN, without warmup (Wortsman et al. 2023)",
           "S3": "warmup rescues post-LN where it failed without (Xiong 2020; Nguyen & Salazar 2019)",
           "S4a": "warmup lowers post-LN's LR sensitivity (Wortsman et al. 2023)",
           "S4b": "warmup lowers pre-LN's LR sensitivity (Wortsman et al. 2023)"},
    "E3": {"P5": "naive BN with batch statistics loses accuracy when the same batches carry more padding",
           "P6": "trained on random, padded batches, naive BN ends below LN (Shen et al. 2020)",
           "S5": "naive BN's batch statistics drift more from the running ones with random batches (Shen 2020)"},
    "E4": {"P7": "without qk_norm the attention logits grow at high LR; qk_norm keeps them small (Wortsman 2023)"},
}


class StudyData:
    """The records of one study: runs (one dict per training run), e1 rows and the gold labels per split."""

    def __init__(self, runs: list[dict], e1: list[dict], labels: dict):
        self.runs, self.e1 = runs, e1
        self.labels = {k: np.array([int(c) for c in v]) for k, v in labels.items()}

    @classmethod
    def load(cls, folder: Path) -> "StudyData":
        folder = Path(folder)
        if not (folder / "runs.jsonl").is_file():
            raise FileNotFoundError(f"{folder}/runs.jsonl not found: run `python scripts/score_runs.py {folder}` "
                                    f"on a finished study first")
        labels = read_json(folder / "labels.json", {})
        return cls(read_jsonl(folder / "runs.jsonl"), read_jsonl(folder / "e1.jsonl"), labels)

    def arm(self, experiment, variant, warmup="on", lr=None) -> list[dict]:
        """Runs of one arm, sorted by (lr, seed)."""
        rows = [r for r in self.runs if r["experiment"] == experiment and r["variant"] == variant
                and r["warmup"] == warmup and (lr is None or math.isclose(r["lr"], lr))]
        return sorted(rows, key=lambda r: (r["lr"], r["seed"]))

    def lrs(self, experiment) -> list[float]:
        return sorted({r["lr"] for r in self.runs if r["experiment"] == experiment})

    def correct(self, run: dict, key: str = VAL) -> np.ndarray:
        """(N,) 1 where the run's saved prediction matches the gold label."""
        pred = np.array([int(c) for c in run["scores"][key]["pred"]])
        return (pred == self.labels[key.split("/")[0]]).astype(float)


def score(run: dict, key: str = VAL, field: str = "loss") -> float:
    return run.get("scores", {}).get(key, {}).get(field, float("nan"))


def failed(run: dict) -> bool:
    return run["status"] != "completed" or not score(run, VAL, "accuracy") >= FAIL_ACCURACY


def initial_loss(runs: list[dict]) -> float:
    firsts = [r["curves"]["loss"][0] for r in runs if r.get("curves", {}).get("loss")]
    return float(np.mean(firsts)) if firsts else math.log(2)


def sensitivity_by_seed(data: StudyData, experiment, variant, warmup) -> dict:
    """{seed: Wortsman LR sensitivity of validation loss over the experiment's LRs} for one arm."""
    runs = data.arm(experiment, variant, warmup)
    l0 = initial_loss(runs)
    out = {}
    for seed in sorted({r["seed"] for r in runs}):
        losses = {r["lr"]: (score(r) if r["status"] == "completed" else math.inf) for r in runs if r["seed"] == seed}
        out[seed] = lr_sensitivity({lr: (x if math.isfinite(x) else math.inf) for lr, x in losses.items()}, l0)
    return out


def best_lr(data: StudyData, experiment, variant, warmup) -> float:
    """The LR with the lowest mean dev loss over seeds (a failed run counts as infinitely bad)."""
    runs = data.arm(experiment, variant, warmup)
    def mean_dev(lr):
        vals = [score(r, DEV) if r["status"] == "completed" else math.inf for r in runs if r["lr"] == lr]
        return float(np.mean(vals)) if vals else math.inf
    return min(sorted({r["lr"] for r in runs}), key=mean_dev)


def paired_by_seed(a: dict, b: dict, fn=lambda x, y: x - y) -> list[float]:
    return [fn(a[s], b[s]) for s in sorted(set(a) & set(b))]


# ----------------------------------------------------------------------------------------------------------------
# E1


def e1_rows(data: StudyData, placement: str, depth: int) -> dict:
    return {r["seed"]: r for r in data.e1 if r["placement"] == placement and r["depth"] == depth}


def e1_grad_log_ratio(row) -> float:
    return math.log(row["grad_norm"][-1] / row["grad_norm"][0])


def p1(data: StudyData, depth: int = 48) -> Estimate:
    post, pre = e1_rows(data, "post", depth), e1_rows(data, "pre", depth)
    return paired_t(paired_by_seed(post, pre, lambda x, y: e1_grad_log_ratio(x) - e1_grad_log_ratio(y)))


def s1(data: StudyData) -> dict:
    """{depth: mean over seeds of pre-LN's g_last / g_first}."""
    depths = sorted({r["depth"] for r in data.e1})
    return {d: float(np.mean([math.exp(e1_grad_log_ratio(r)) for r in e1_rows(data, "pre", d).values()]))
            for d in depths}


def p2(data: StudyData, depth: int = 48) -> Estimate:
    post, deep = e1_rows(data, "post", depth), e1_rows(data, "deepnorm", depth)
    return paired_t(paired_by_seed(post, deep, lambda x, y: math.log(x["output_change"][-1] / y["output_change"][-1])))


def depth_slope(data: StudyData, placement: str) -> dict:
    """{seed: slope of log(10-step output change) against log(depth)}."""
    by_seed = {}
    for r in data.e1:
        if r["placement"] == placement:
            by_seed.setdefault(r["seed"], []).append((math.log(r["depth"]), math.log(r["output_change"][-1])))
    return {s: float(np.polyfit(*zip(*pts), 1)[0]) for s, pts in by_seed.items() if len(pts) > 1}


def s2(data: StudyData) -> tuple[Estimate, Estimate]:
    post, deep = depth_slope(data, "post"), depth_slope(data, "deepnorm")
    return paired_t(list(post.values())), paired_t(paired_by_seed(post, deep))


# ----------------------------------------------------------------------------------------------------------------
# E2 (and the A/A control, E4): placement, warmup and LR


def failures(data: StudyData, experiment, variant, warmup, lrs) -> tuple[int, int]:
    runs = [r for lr in lrs for r in data.arm(experiment, variant, warmup, lr)]
    return sum(failed(r) for r in runs), len(runs)


def p3(data: StudyData) -> dict:
    top = data.lrs("e2")[-2:]
    post, pre = failures(data, "e2", "post_ln", "off", top), failures(data, "e2", "pre_ln", "off", top)
    return {"lrs": top, "post": post, "pre": pre, "p": fisher_greater(post[0], post[1], pre[0], pre[1])}


def p4(data: StudyData, warmup: str = "off") -> Estimate:
    post = sensitivity_by_seed(data, "e2", "post_ln", warmup)
    pre = sensitivity_by_seed(data, "e2", "pre_ln", warmup)
    return paired_t(paired_by_seed(post, pre))


def s3(data: StudyData) -> dict:
    """Validation loss with warmup minus without for post-LN, at the LRs where warmup-off failed in >= 2 seeds."""
    lrs = [lr for lr in data.lrs("e2") if failures(data, "e2", "post_ln", "off", [lr])[0] >= 2]
    l0 = initial_loss(data.arm("e2", "post_ln", "off"))
    loss = lambda r: score(r) if r["status"] == "completed" else l0
    diffs = []
    for lr in lrs:
        on = {r["seed"]: loss(r) for r in data.arm("e2", "post_ln", "on", lr)}
        off = {r["seed"]: loss(r) for r in data.arm("e2", "post_ln", "off", lr)}
        diffs += paired_by_seed(on, off)
    return {"lrs": lrs, "estimate": paired_t(diffs, greater=False)}


def s4(data: StudyData, variant: str) -> Estimate:
    on = sensitivity_by_seed(data, "e2", variant, "on")
    off = sensitivity_by_seed(data, "e2", variant, "off")
    return paired_t(paired_by_seed(on, off), greater=False)


def accuracy_table(data: StudyData, arms: list[tuple]) -> list[dict]:
    """Per arm (experiment, variant, warmup): the dev-selected LR and validation accuracy/loss there, per seed."""
    rows = []
    for experiment, variant, warmup in arms:
        lr = best_lr(data, experiment, variant, warmup)
        runs = data.arm(experiment, variant, warmup, lr)
        rows.append({"experiment": experiment, "variant": variant, "warmup": warmup, "best_lr": lr,
                     "accuracy": [score(r, VAL, "accuracy") for r in runs], "loss": [score(r) for r in runs],
                     "failed": failures(data, experiment, variant, warmup, data.lrs(experiment)),
                     "sensitivity": sensitivity_by_seed(data, experiment, variant, warmup),
                     "spikes": sum(r.get("loss_spikes") or 0 for r in data.arm(experiment, variant, warmup))})
    return rows


def aa_control(data: StudyData) -> dict:
    """custom_ln (A/A arm) against e2's pre_ln, warmup on, per LR: paired accuracy and loss differences."""
    per_lr, floor = [], 0.0
    for lr in data.lrs("aa"):
        a = {r["seed"]: r for r in data.arm("aa", "custom_ln", "on", lr) if "scores" in r}
        b = {r["seed"]: r for r in data.arm("e2", "pre_ln", "on", lr) if "scores" in r}
        seeds = sorted(set(a) & set(b))
        if not seeds:
            continue
        acc = paired_bootstrap([data.correct(a[s]) for s in seeds], [data.correct(b[s]) for s in seeds])
        loss = paired_t([score(a[s]) - score(b[s]) for s in seeds])
        per_lr.append({"lr": lr, "accuracy": acc, "loss": loss, "seeds": len(seeds)})
        floor = max(floor, abs(acc.mean))
    return {"per_lr": per_lr, "floor": floor}


# ----------------------------------------------------------------------------------------------------------------
# E3: BatchNorm and padding


E3_NORMS = ("layernorm", "batchnorm", "masked_batchnorm")  # the arms of configs/study/*.yaml's e3
E3_BN_NORMS = tuple(n for n in E3_NORMS if n in BATCH_STAT_NORMS)  # those with running statistics


def e3_runs(data: StudyData, norm: str, batches: str) -> list[dict]:
    return [r for r in data.arm("e3", f"{norm}-{batches}") if "scores" in r]


def flips(run: dict, a: str, b: str, mode: str) -> int | None:
    ka, kb = f"val/{a}/{mode}", f"val/{b}/{mode}"
    if ka not in run["scores"] or kb not in run["scores"]:
        return None
    return sum(x != y for x, y in zip(run["scores"][ka]["pred"], run["scores"][kb]["pred"]))


def e3_table(data: StudyData) -> list[dict]:
    """Per (norm, training batches, statistics mode, eval batching): accuracy per seed and flips vs sorted."""
    rows = []
    for norm in E3_NORMS:
        for batches in ("random", "grouped"):
            runs = e3_runs(data, norm, batches)
            for mode in ("running", "batch"):
                for how in ("sorted", "shuffled", "fixed"):
                    key = f"val/{how}/{mode}"
                    if not runs or key not in runs[0]["scores"]:
                        continue
                    rows.append({"norm": norm, "batches": batches, "mode": mode, "eval": how,
                                 "accuracy": [r["scores"][key]["accuracy"] for r in runs],
                                 "flips": [flips(r, "sorted", how, mode) for r in runs]})
    return rows


def structural_checks(data: StudyData) -> list[dict]:
    """What must hold exactly; each row says whether it did."""
    checks = []
    def total(norm, a, b, mode):
        counts = [flips(r, a, b, mode) for bt in ("random", "grouped") for r in e3_runs(data, norm, bt)]
        return sum(c for c in counts if c is not None)
    for a, b in (("sorted", "shuffled"), ("sorted", "fixed")):
        checks.append({"check": f"LN flips none, {a} vs {b}", "flips": total("layernorm", a, b, "running"),
                       "expected": 0})
        for norm in E3_BN_NORMS:
            checks.append({"check": f"{norm}, running statistics, flips none, {a} vs {b}",
                           "flips": total(norm, a, b, "running"), "expected": 0})
    checks.append({"check": "masked_batchnorm, batch statistics, flips none, sorted vs fixed",
                   "flips": total("masked_batchnorm", "sorted", "fixed", "batch"), "expected": 0})
    for c in checks:
        c["held"] = c["flips"] == c["expected"]
    return checks


def running_stats_table(data: StudyData) -> list[dict]:
    """Per batch-statistics arm of E3, per seed: how far the running statistics eval uses sit from the statistics
    of the real tokens (score_runs.py's `running_stats`), in the first norm layer, whose input no batch statistics
    have touched, and averaged over layers. Descriptive: no prediction was written about it."""
    rows = []
    for norm in E3_BN_NORMS:
        for batches in ("random", "grouped"):
            gaps = [r["running_stats"] for r in e3_runs(data, norm, batches) if "running_stats" in r]
            if gaps:
                rows.append({"norm": norm, "batches": batches,
                             "first_mean_gap": [g["mean_gap"][0] for g in gaps],
                             "first_log_var_ratio": [g["log_var_ratio"][0] for g in gaps],
                             "mean_gap": [float(np.mean(g["mean_gap"])) for g in gaps],
                             "log_var_ratio": [float(np.mean(g["log_var_ratio"])) for g in gaps]})
    return rows


def p5(data: StudyData) -> dict:
    runs = e3_runs(data, "batchnorm", "random") + e3_runs(data, "batchnorm", "grouped")
    fixed = [data.correct(r, "val/fixed/batch") for r in runs]
    sorted_ = [data.correct(r, "val/sorted/batch") for r in runs]
    return {"flips": sum(flips(r, "sorted", "fixed", "batch") or 0 for r in runs), "runs": len(runs),
            "estimate": paired_bootstrap(fixed, sorted_, greater=False)}


def p6(data: StudyData, batches: str = "random") -> Estimate:
    bn = {r["seed"]: data.correct(r) for r in e3_runs(data, "batchnorm", batches)}
    ln = {r["seed"]: data.correct(r) for r in e3_runs(data, "layernorm", batches)}
    seeds = sorted(set(bn) & set(ln))
    return paired_bootstrap([bn[s] for s in seeds], [ln[s] for s in seeds], greater=False)


def mean_drift(run: dict) -> float:
    drift = [x for x in run.get("curves", {}).get("stat_drift", []) if x is not None]
    return float(np.mean(drift[len(drift) // 2:])) if drift else float("nan")


def s5(data: StudyData, norm: str = "batchnorm") -> Estimate:
    rnd = {r["seed"]: mean_drift(r) for r in data.arm("e3", f"{norm}-random")}
    grp = {r["seed"]: mean_drift(r) for r in data.arm("e3", f"{norm}-grouped")}
    return paired_t(paired_by_seed(rnd, grp))


# ----------------------------------------------------------------------------------------------------------------
# E4: attention logits


def final_logit_max(run: dict) -> float:
    series = [x for x in run.get("curves", {}).get("attn_logit_max", []) if x is not None]
    return series[-1] if series and run["status"] == "completed" else float("nan")


def p7(data: StudyData) -> Estimate:
    top = data.lrs("e4")[-1]
    without = {r["seed"]: final_logit_max(r) for r in data.arm("e2", "pre_ln", "on", top)}
    with_qk = {r["seed"]: final_logit_max(r) for r in data.arm("e4", "pre_ln_qknorm", "on", top)}
    return paired_t(paired_by_seed(without, with_qk, lambda a, b: math.log(a / b)))


def e4_sensitivity(data: StudyData) -> Estimate:
    without = sensitivity_by_seed(data, "e2", "pre_ln", "on")
    with_qk = sensitivity_by_seed(data, "e4", "pre_ln_qknorm", "on")
    return paired_t(paired_by_seed(without, with_qk))


# ----------------------------------------------------------------------------------------------------------------
# Verdicts


def outcome(est: Estimate, p_adjusted: float, greater: bool, floor: float | None = None) -> str:
    """confirmed: the predicted direction is significant (after Holm for primaries) and, for accuracies, larger
    than the A/A noise floor; refuted: the interval lies entirely on the other side of 0; else not separated."""
    if not np.isfinite(est.mean):
        return "not measured"
    if p_adjusted < ALPHA and (floor is None or abs(est.mean) > floor):
        return "confirmed"
    if (greater and est.hi < 0) or (not greater and est.lo > 0):
        return "refuted"
    return "not separated"


def verdicts(data: StudyData) -> list[dict]:
    """One row per hypothesis: its estimate, raw and Holm-adjusted p, and the outcome."""
    floor = aa_control(data)["floor"] if any(r["experiment"] == "aa" for r in data.runs) else None
    rows = {}
    if data.e1:
        rows["P1"] = ("E1", "post-LN log(g_last/g_first) minus pre-LN's, depth 48", p1(data), True, None)
        rows["P2"] = ("E1", "log(10-step output change) post-LN minus DeepNorm, depth 48", p2(data), True, None)
    if any(r["experiment"] == "e2" for r in data.runs):
        f = p3(data)
        est = Estimate(f["post"][0] / max(f["post"][1], 1) - f["pre"][0] / max(f["pre"][1], 1),
                       float("nan"), float("nan"), f["p"], f["post"][1] + f["pre"][1])
        rows["P3"] = ("E2", f"failure rate post-LN minus pre-LN, no warmup, LRs {', '.join(f'{x:g}' for x in f['lrs'])}"
                      f" ({f['post'][0]}/{f['post'][1]} vs {f['pre'][0]}/{f['pre'][1]})", est, True, None)
        rows["P4"] = ("E2", "LR sensitivity post-LN minus pre-LN, no warmup", p4(data), True, None)
    if any(r["experiment"] == "e4" for r in data.runs):
        rows["P7"] = ("E4", "log(final max attention logit) without minus with qk_norm, highest LR", p7(data), True, None)
    if any(r["experiment"] == "e3" for r in data.runs):
        rows["P5"] = ("E3", "naive BN accuracy, batch statistics, fixed minus sorted padding", p5(data)["estimate"],
                      False, None)
        rows["P6"] = ("E3", "accuracy naive BN minus LN, trained on random batches", p6(data), False, floor)
    adjusted = holm({k: v[2].p for k, v in rows.items()})
    out = []
    for key in sorted(rows):
        exp, what, est, greater, fl = rows[key]
        out.append({"id": key, "experiment": exp, "what": what, "estimate": est, "p": est.p,
                    "p_holm": adjusted[key], "outcome": outcome(est, adjusted[key], greater, fl)})
    return out


def secondary(data: StudyData) -> list[dict]:
    """Exploratory hypotheses, uncorrected."""
    out = []
    if data.e1:
        ratios = s1(data)
        inside = all(0.5 <= v <= 2 for v in ratios.values())
        out.append({"id": "S1", "what": "pre-LN g_last/g_first within [0.5, 2] at every depth",
                    "value": ", ".join(f"{d}: {v:.3g}" for d, v in ratios.items()),
                    "outcome": "confirmed" if inside else "refuted"})
        slope_post, slope_diff = s2(data)
        out.append({"id": "S2", "what": "slope of log(change) vs log(depth): post-LN; post-LN minus DeepNorm",
                    "value": f"{slope_post.fmt()}; {slope_diff.fmt()}",
                    "outcome": "confirmed" if slope_post.lo > 0 and slope_diff.lo > 0 else
                    ("refuted" if slope_post.hi < 0 or slope_diff.hi < 0 else "not separated")})
    if any(r["experiment"] == "e2" for r in data.runs):
        s3_ = s3(data)
        est = s3_["estimate"]
        out.append({"id": "S3", "what": f"post-LN val loss, warmup on minus off, at LRs {s3_['lrs']} (failed without)",
                    "value": est.fmt() if s3_["lrs"] else "no LR where post-LN without warmup failed",
                    "outcome": _sign_outcome(est, greater=False) if s3_["lrs"] else "not testable"})
        for variant, key in (("post_ln", "S4a"), ("pre_ln", "S4b")):
            est = s4(data, variant)
            out.append({"id": key, "what": f"LR sensitivity warmup on minus off, {variant}", "value": est.fmt(),
                        "outcome": _sign_outcome(est, greater=False)})
    if any(r["experiment"] == "e3" for r in data.runs):
        est = s5(data)
        out.append({"id": "S5", "what": "naive BN stat drift (2nd half), random minus grouped batches",
                    "value": est.fmt(4), "outcome": _sign_outcome(est, greater=True)})
    return out


def _sign_outcome(est: Estimate, greater: bool) -> str:
    if not np.isfinite(est.lo):
        return "not separated"
    if (greater and est.lo > 0) or (not greater and est.hi < 0):
        return "confirmed"
    if (greater and est.hi < 0) or (not greater and est.lo > 0):
        return "refuted"
    return "not separated"
