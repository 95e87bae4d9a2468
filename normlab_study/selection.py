"""Each arm at its own best learning rate: chosen on the dev split, never on the split the study reports.

A tuning experiment trains every arm over an LR grid (a few seeds); each final model's loss on the dev rows (the
last rows of the training split, which no run trains on) is averaged over seeds, and the LR with the lowest mean
wins. A run that diverged or crashed counts as infinitely bad. The choice is written once to STUDY/selection.json
and reused by every later invocation, so adding tuning seeds later never silently moves runs that were trained.
"""

import math
from pathlib import Path

import numpy as np
import torch

from common.batching import encode_rows
from common.io import atomic_write_json, read_json, read_yaml
from normlab_study.scoring import load_final, predict, score_sets


def dev_loss(run_dir: Path, dev, batch_size: int) -> float:
    """Mean cross-entropy of the run's final model on the dev rows (length-sorted batches, running statistics)."""
    if (read_json(run_dir / "summary.json") or {}).get("status") != "completed" or not (run_dir / "final").is_dir():
        return math.inf
    cfg = read_yaml(run_dir / "config.yaml")
    model, tokenizer = load_final(run_dir)
    texts, labels = dev
    max_length = cfg["data"]["max_length"]
    rows = encode_rows(tokenizer, texts, max_length, labels)
    loss = predict(model, rows, "sorted", batch_size, max_length, tokenizer.pad_token_id)["loss"]
    return float(loss) if loss is not None else math.inf  # predict's loss is None when it is not finite


def best_lr(dev_loss_by_lr: dict) -> float:
    """The LR with the lowest mean dev loss over seeds ({lr: [loss per seed]}); ties go to the smaller LR."""
    return min(sorted(dev_loss_by_lr), key=lambda lr: float(np.mean(dev_loss_by_lr[lr])))


def select(study_dir: Path, candidates: dict, score: dict) -> dict:
    """{key: {lr: [run names]}} -> {key: {"lr": best, "dev_loss": {lr: mean}}}, for the keys not chosen before;
    merged into STUDY/selection.json (earlier choices are kept as they are)."""
    path = study_dir / "selection.json"
    chosen = read_json(path, {}) or {}
    todo = {k: v for k, v in candidates.items() if k not in chosen}
    if todo:
        first = next(n for runs in todo.values() for names in runs.values() for n in names)
        cfg = read_yaml(study_dir / "runs" / first / "config.yaml")
        dev = score_sets(cfg, score.get("dev_rows", 2000))["dev"]
        torch.set_num_threads(1)
        for key, by_lr in todo.items():
            losses = {lr: [dev_loss(study_dir / "runs" / n, dev, score.get("batch_size", 32)) for n in names]
                      for lr, names in by_lr.items()}
            lr = best_lr(losses)
            chosen[key] = {"lr": lr, "dev_loss": {f"{k:g}": round(float(np.mean(v)), 5) for k, v in losses.items()},
                           "runs": {f"{k:g}": names for k, names in by_lr.items()}}
        atomic_write_json(path, chosen, indent=1)
    return chosen
