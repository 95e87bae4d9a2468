"""Study v3's hypotheses (docs/study-v3/predictions.md), each as per-seed paired differences, a test and the
direction the paper predicts; `verdicts` turns them into confirmed / refuted / not separated / horizon too short."""

import math
from dataclasses import dataclass, field

import numpy as np

from normlab.study.analysis import (
    ALPHA,
    BATCH_STAT,
    Records,
    aa_calibration,
    arm_summary,
    by_seed,
    largest_lr_by_seed,
    paired,
    sensitivity_diffs,
    value,
)
from normlab.study.seedstats import Paired, holm, paired_test

EQUIVALENCE = 0.02  # S1, S2: "matches" = the whole interval within +-0.02 accuracy


@dataclass
class Hypothesis:
    id: str
    claim: str
    diffs: list
    test: str
    sign: int  # the predicted sign of the mean difference (-1, +1; 0: an equivalence claim)
    arms: list = field(default_factory=list)  # leaderboard arms whose horizon must hold
    primary: bool = False
    estimate: Paired | None = None
    p_adjusted: float = float("nan")
    verdict: str = ""


def board(rec: Records, variant: str, field_: str = "accuracy") -> dict:
    return by_seed(rec.arm("leaderboard", variant), lambda r: value(r, field_))


def primary(rec: Records, test: str) -> list[Hypothesis]:
    """P1-P6. `test` is the one the A/A control calibrated for continuous quantities."""
    largest = {(v, w): largest_lr_by_seed(rec, v, w) for v in ("ln_post", "ln_pre") for w in ("on", "off")}
    return [
        Hypothesis("P1", "without warmup post-LN learns only at smaller LRs than pre-LN (Xiong et al. 2020): "
                   "log10 largest learning LR, post - pre",
                   paired(largest["ln_post", "off"], largest["ln_pre", "off"]), "wilcoxon", -1, primary=True),
        Hypothesis("P2", "warmup raises post-LN's largest learning LR (Xiong 2020; Nguyen & Salazar 2019): "
                   "log10 LR, warmup on - off",
                   paired(largest["ln_post", "on"], largest["ln_post", "off"]), "wilcoxon", +1, primary=True),
        Hypothesis("P3", "post-LN is more LR-sensitive than pre-LN without warmup (Wortsman et al. 2023): "
                   "sensitivity, post - pre", sensitivity_diffs(rec, "ln_post", "ln_pre"), test, +1, primary=True),
        Hypothesis("P4", "at their own tuned LRs naive BN is less accurate than LN (Shen et al. 2020): "
                   "accuracy, batchnorm - ln_pre", paired(board(rec, "batchnorm"), board(rec, "ln_pre")), test, -1,
                   ["batchnorm", "ln_pre"], True),
        Hypothesis("P5", "masked BN is more accurate than naive BN on padded batches: accuracy, masked - naive",
                   paired(board(rec, "masked_batchnorm"), board(rec, "batchnorm")), test, +1,
                   ["masked_batchnorm", "batchnorm"], True),
        Hypothesis("P6", "DyT's validation loss is lower than LN's with little data (arXiv 2604.23434): "
                   "loss, dyt - ln_pre", paired(board(rec, "dyt", "loss"), board(rec, "ln_pre", "loss")), test, -1,
                   ["dyt", "ln_pre"], True),
    ]


def secondary(rec: Records, test: str) -> list[Hypothesis]:
    acc = {v: board(rec, v) for v in ("ln_pre", "dyt", "rmsnorm", "no_norm", "powernorm", "batchnorm",
                                       "masked_batchnorm")}
    extra = lambda variant: by_seed(rec.arm("batching", variant), value)  # noqa: E731 - a one-line local helper
    b8 = {n: paired(extra(f"{n}-b8"), acc[n]) for n in ("ln_pre", "batchnorm")}
    b8 = [x - y for x, y in zip(b8["batchnorm"], b8["ln_pre"])]
    grouped = paired(extra("masked_batchnorm-grouped"), extra("batchnorm-grouped"))
    random_ = paired(acc["masked_batchnorm"], acc["batchnorm"])[:len(grouped)]
    more = lambda v: largest_lr_by_seed(rec, v, "off", "placement_more")  # noqa: E731 - a one-line local helper
    pre_off, post_off = largest_lr_by_seed(rec, "ln_pre", "off"), largest_lr_by_seed(rec, "ln_post", "off")
    return [
        Hypothesis("S1", "DyT matches LN (Zhu et al. 2025): accuracy, dyt - ln_pre within +-0.02",
                   paired(acc["dyt"], acc["ln_pre"]), test, 0, ["dyt", "ln_pre"]),
        Hypothesis("S2", "RMSNorm matches LN (Zhang & Sennrich 2019): accuracy within +-0.02",
                   paired(acc["rmsnorm"], acc["ln_pre"]), test, 0, ["rmsnorm", "ln_pre"]),
        Hypothesis("S3", "no norm is less accurate than LN: accuracy, no_norm - ln_pre",
                   paired(acc["no_norm"], acc["ln_pre"]), test, -1, ["no_norm", "ln_pre"]),
        Hypothesis("S4", "PowerNorm is more accurate than naive BN (Shen 2020): accuracy, powernorm - batchnorm",
                   paired(acc["powernorm"], acc["batchnorm"]), test, +1, ["powernorm", "batchnorm"]),
        Hypothesis("S5a", "batches of 8 cost naive BN more than LN: (BN8 - BN32) - (LN8 - LN32)", b8, test, -1),
        Hypothesis("S5b", "length-grouped batches narrow masked BN's lead over naive BN: grouped - random",
                   [g - r for g, r in zip(grouped, random_)], test, -1),
        Hypothesis("S6", "naive BN's batch statistics drift further from the running ones than masked BN's "
                   "(Shen 2020): mean stat drift, naive - masked", paired(drift(rec, "batchnorm"),
                                                                          drift(rec, "masked_batchnorm")), test, +1),
        Hypothesis("S8a", "qk_norm raises pre-LN's largest learning LR without warmup: log10 LR, qk_norm - pre",
                   paired(more("ln_pre_qknorm"), pre_off), "wilcoxon", +1),
        Hypothesis("S8b", "sandwich (Peri-LN) learns at LRs as large as pre-LN: log10 LR, sandwich - pre",
                   paired(more("sandwich"), pre_off), "wilcoxon", +1),
        Hypothesis("S8c", "DeepNorm learns at larger LRs than post-LN: log10 LR, deepnorm - post",
                   paired(more("deepnorm"), post_off), "wilcoxon", +1),
    ] + e1_hypotheses(rec, test)


def e1_hypotheses(rec: Records, test: str) -> list[Hypothesis]:
    """E1 (no training), at the deepest model: Xiong 2020's gradient growth toward the output under post-LN, and
    DeepNet's larger early update of post-LN than of DeepNorm."""
    if not rec.e1:
        return []
    depth = max(r["depth"] for r in rec.e1)
    rows = {p: {r["seed"]: r for r in rec.e1 if r["placement"] == p and r["depth"] == depth}
            for p in ("post", "pre", "deepnorm")}
    grad = {p: {s: math.log(r["grad_norm"][-1] / r["grad_norm"][0]) for s, r in rows[p].items()} for p in rows}
    change = {p: {s: math.log(r["output_change"][-1]) for s, r in rows[p].items()} for p in rows}
    return [Hypothesis("E1a", f"at init post-LN's gradients grow toward the output more than pre-LN's (Xiong 2020): "
                       f"log(g_last / g_first), post - pre, depth {depth}", paired(grad["post"], grad["pre"]), test,
                       +1),
            Hypothesis("E1b", f"post-LN's 10-step output change is larger than DeepNorm's (Wang et al. 2022): "
                       f"log change, post - deepnorm, depth {depth}", paired(change["post"], change["deepnorm"]),
                       test, +1)]


def drift(rec: Records, variant: str) -> dict:
    def mean_drift(run):
        values = [x for x in run.get("curves", {}).get("stat_drift", []) if x is not None]
        return float(np.mean(values)) if values else float("nan")
    return by_seed(rec.arm("leaderboard", variant), mean_drift)


def verdict(h: Hypothesis, horizon: dict) -> str:
    est = h.estimate
    if any(not horizon.get(a, False) for a in h.arms):
        return "horizon too short"
    if est.n < 2 or not math.isfinite(est.mean):
        return "no data"
    if h.sign == 0:
        return "matches (within ±0.02)" if -EQUIVALENCE < est.lo and est.hi < EQUIVALENCE else "not shown to match"
    p = h.p_adjusted if h.primary else est.p
    if not p < ALPHA:
        return "not separated"
    return "confirmed" if np.sign(est.mean) == h.sign else "refuted"


def verdicts(rec: Records) -> tuple[dict, list[Hypothesis]]:
    """(the A/A calibration, every hypothesis with its estimate and verdict). Primary p values are Holm-adjusted."""
    aa = aa_calibration(rec)
    hyps = primary(rec, aa["test"]) + secondary(rec, aa["test"])
    for h in hyps:
        h.estimate = paired_test(h.diffs, h.test)
    adjusted = holm({h.id: h.estimate.p for h in hyps if h.primary})
    horizon = {v: arm_summary(rec.arm("leaderboard", v))["horizon_ok"] for v in {a for h in hyps for a in h.arms}}
    for h in hyps:
        h.p_adjusted = adjusted.get(h.id, float("nan"))
        h.verdict = verdict(h, horizon)
    return aa, hyps


def flip_table(rec: Records) -> list[dict]:
    """Per batch-statistics norm (leaderboard runs): predictions that change with padding only (the same batches
    padded to their longest vs to the maximum length) and with batch composition (sorted vs shuffled), each
    with batch statistics and with running statistics."""
    def flips(run, a, b, mode):
        ka, kb = f"val/{a}/{mode}", f"val/{b}/{mode}"
        s = run.get("scores", {})
        return sum(x != y for x, y in zip(s[ka]["pred"], s[kb]["pred"])) if ka in s and kb in s else None
    rows = []
    for norm in BATCH_STAT:
        runs = rec.arm("leaderboard", norm)
        for mode in ("batch", "running"):
            pad = [flips(r, "sorted", "fixed", mode) for r in runs]
            comp = [flips(r, "sorted", "shuffled", mode) for r in runs]
            rows.append({"norm": norm, "mode": mode, "padding": [x for x in pad if x is not None],
                         "composition": [x for x in comp if x is not None]})
    return rows
