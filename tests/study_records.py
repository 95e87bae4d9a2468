"""A synthetic study's records (runs.jsonl, e1.jsonl, labels.json) whose every effect is set by hand, so the
report's numbers can be checked against what was planted."""

import json
import math

import numpy as np

N_VAL, N_DEV = 40, 20
LRS = [1e-3, 1e-2, 3e-2]
SEEDS = [0, 1, 2]
VAL_LABELS = [i % 2 for i in range(N_VAL)]
DEV_LABELS = [i % 2 for i in range(N_DEV)]


def preds(n_correct: int, labels, shift: int = 0) -> str:
    """Predictions right on exactly n_correct examples (the first ones, rotated by `shift`)."""
    n = len(labels)
    right = {(i + shift) % n for i in range(n_correct)}
    return "".join(str(y if i in right else 1 - y) for i, y in enumerate(labels))


def scores(n_correct: int, loss: float, shift: int = 0, extra: dict | None = None) -> dict:
    out = {"val/sorted/running": {"loss": loss, "accuracy": n_correct / N_VAL, "pred": preds(n_correct, VAL_LABELS, shift)},
           "dev/sorted/running": {"loss": loss, "accuracy": 0.7, "pred": preds(14, DEV_LABELS)}}
    return {**out, **(extra or {})}


def run(experiment, variant, lr, warmup, seed, n_correct, loss, norm="layernorm", curves_extra=None, extra=None,
        status="completed"):
    curves = {"step": [1, 2, 3, 4], "loss": [0.7, 0.6, 0.5, 0.45], "grad_norm": [1, 1, 1, 1], **(curves_extra or {})}
    rec = {"experiment": experiment, "variant": variant, "lr": lr, "warmup": warmup, "seed": seed, "status": status,
           "name": f"{experiment}-{variant}-lr{lr:g}-wu{warmup}-s{seed}", "norm": norm, "loss_spikes": 0,
           "curves": curves}
    if status == "completed":
        rec["scores"] = scores(n_correct, loss, seed, extra)
    return rec


def e2_runs() -> list[dict]:
    """post-LN without warmup learns nothing at the two highest LRs (20/40 right, loss ln 2); everything else
    gets 30/40 right with loss 0.5 (pre-LN) or 0.55 (post-LN with warmup)."""
    out = []
    for lr in LRS:
        for seed in SEEDS:
            for warmup in ("on", "off"):
                fail = warmup == "off" and lr > 1e-3
                out.append(run("e2", "post_ln", lr, warmup, seed, 20 if fail else 30,
                               math.log(2) if fail else 0.55))
                logits = {"attn_logit_max": [1, 2, 4, 8 * lr / 1e-3]}
                out.append(run("e2", "pre_ln", lr, warmup, seed, 30, 0.5, curves_extra=logits))
            out.append(run("aa", "custom_ln", lr, "on", seed, 30, 0.5))  # identical to pre_ln: A/A floor 0
            out.append(run("e4", "pre_ln_qknorm", lr, "on", seed, 30, 0.5, curves_extra={"attn_logit_max": [1, 1, 1, 2]}))
    return out


# per (norm, training batches): two layers' gaps between running and real-token statistics
RUNNING_STATS = {("batchnorm", "random"): {"mean_gap": [0.6, 0.4], "log_var_ratio": [0.8, 0.2]},
                 ("batchnorm", "grouped"): {"mean_gap": [0.2, 0.2], "log_var_ratio": [0.1, 0.1]},
                 ("masked_batchnorm", "random"): {"mean_gap": [0.0, 0.1], "log_var_ratio": [0.0, 0.1]},
                 ("masked_batchnorm", "grouped"): {"mean_gap": [0.0, 0.1], "log_var_ratio": [0.0, 0.1]}}


def e3_runs() -> list[dict]:
    """LN: identical predictions in every batching. Naive BN: batch statistics lose 4 answers with fixed padding
    and 2 with shuffled batches. Masked BN: batch statistics change only with shuffled batches."""
    out = []
    for batches in ("random", "grouped"):
        for seed in SEEDS:
            def batching(n_by_how, modes):
                return {f"val/{how}/{mode}": {"loss": 0.5, "accuracy": n / N_VAL, "pred": preds(n, VAL_LABELS, seed)}
                        for mode in modes for how, n in n_by_how.items()}
            ln = batching({"sorted": 30, "shuffled": 30, "fixed": 30}, ["running"])
            bn = {**batching({"sorted": 28, "shuffled": 28, "fixed": 28}, ["running"]),
                  **batching({"sorted": 30, "shuffled": 28, "fixed": 26}, ["batch"])}
            mbn = {**batching({"sorted": 30, "shuffled": 30, "fixed": 30}, ["running"]),
                   **batching({"sorted": 30, "shuffled": 29, "fixed": 30}, ["batch"])}
            drift = {"stat_drift": [0.4, 0.4, 0.4, 0.4] if batches == "random" else [0.1, 0.1, 0.1, 0.1]}
            out.append(run("e3", f"layernorm-{batches}", 1e-3, "on", seed, 30, 0.5, extra=ln))
            out.append(run("e3", f"batchnorm-{batches}", 1e-3, "on", seed, 28, 0.55, "batchnorm", drift, bn))
            out[-1]["running_stats"] = RUNNING_STATS[("batchnorm", batches)]
            out.append(run("e3", f"masked_batchnorm-{batches}", 1e-3, "on", seed, 30, 0.5, "masked_batchnorm",
                           drift, mbn))
            out[-1]["running_stats"] = RUNNING_STATS[("masked_batchnorm", batches)]
    return out


def e1_rows() -> list[dict]:
    """post-LN: equal gradients in every block, output change growing as depth**0.5; pre-LN: gradients halving
    from first to last block; DeepNorm: output change 0.1 at every depth."""
    out = []
    for placement in ("post", "pre", "deepnorm"):
        for depth in (3, 12, 48):
            for seed in range(5):
                wobble = 1 + 0.01 * seed
                grad = [wobble] * depth if placement != "pre" else list(np.linspace(1.0, 0.5, depth) * wobble)
                change = 0.1 * depth ** 0.5 * wobble if placement == "post" else 0.1 * wobble
                out.append({"placement": placement, "depth": depth, "seed": seed, "loss_at_init": 0.69,
                            "grad_norm": grad, "output_change": [change / 2, change]})
    return out


def write(folder) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    lines = lambda rows: "".join(json.dumps(r) + "\n" for r in rows)
    (folder / "runs.jsonl").write_text(lines(e2_runs() + e3_runs()))
    (folder / "e1.jsonl").write_text(lines(e1_rows()))
    (folder / "labels.json").write_text(json.dumps({"val": "".join(map(str, VAL_LABELS)),
                                                     "dev": "".join(map(str, DEV_LABELS))}))
    (folder / "meta.json").write_text(json.dumps({"name": "st", "commit": "abc1234", "machine": "test", "command": "x"}))
