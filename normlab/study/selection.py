"""Each arm at its own best learning rate, chosen on the dev split (never on the split the study reports): the
lowest mean dev loss over the sweep's seeds; a diverged or crashed run counts as infinitely bad. The choice is
written once to STUDY/selection.json and reused by every later invocation (docs/studies.md).
"""

import math
from pathlib import Path

import numpy as np
import torch

from normlab.files.formats import atomic_write_json, read_jsonl, write_jsonl
from normlab.run_dir import RunDir
from normlab.study.rules import choose_lrs
from normlab.study.scoring import SCORE_DEFAULTS, score_run, score_sets
from normlab.study.selection_file import lr_rows, read_selection
from normlab.study.sharded import run_sharded
from normlab.study.study_dir import StudyDir

DEV_LOSSES = "dev_losses.jsonl"


def dev_loss(run_dir: Path, dev, batch_size: int) -> float:
    """Mean cross-entropy of the run's final model on the dev rows (length-sorted batches, running statistics)."""
    if RunDir(run_dir).status() != "completed" or not RunDir(run_dir).has_final():
        return math.inf
    loss = score_run(run_dir, {"dev": dev}, False, batch_size)[0]["dev/sorted/running"]["loss"]
    return float(loss) if loss is not None else math.inf  # the loss is None when it is not finite


def choice(losses: dict, runs: dict | None = None) -> dict:
    """{lr: [dev loss per seed]} (and {lr: [run names]}) -> the record selection.json keeps: the best LR; with two
    LRs or more also the runner-up, the gap between them, the per-seed SD and whether they are a near tie
    (rules.choose_lrs); and `by_lr`, each LR's mean dev loss, every seed's loss and its runs (selection_file)."""
    picked = choose_lrs(losses)
    out = {"lr": picked["lr"]}
    if "runner_up" in picked:
        out.update({k: picked[k] for k in ("runner_up", "near_tie")})
        # a diverged seed makes the gap or the SD infinite or undefined: null in JSON
        out.update({k: round(picked[k], 5) if math.isfinite(picked[k]) else None for k in ("gap", "seed_sd")})
    tables = {"dev_loss": {lr: round(float(np.mean(v)), 5) for lr, v in losses.items()},
              "dev_loss_by_seed": {lr: [round(float(x), 5) if math.isfinite(x) else None for x in v]
                                   for lr, v in losses.items()}}
    out["by_lr"] = lr_rows({**tables, **({"runs": runs} if runs else {})})
    return out


def dev_losses(study_dir: Path, names: list[str], score: dict, processes: int = 1) -> dict:
    """{run name: dev_loss}, in `processes` processes (run_sharded; each loss is computed alone, so how many
    processes changes nothing but the time). The rows pass through STUDY/dev_losses.jsonl, removed once read:
    selection.json keeps the losses."""
    run_sharded(dev_loss_rows, study_dir, DEV_LOSSES, processes, key=lambda row: row["name"], names=names,
                dev_rows=score["dev_rows"], batch_size=score["batch_size"])
    path = study_dir / DEV_LOSSES
    rows = read_jsonl(path)
    path.unlink()
    return {row["name"]: math.inf if row["dev_loss"] is None else row["dev_loss"] for row in rows}


def select(spec, study_dir: Path, candidates: dict, processes: int = 1) -> dict:
    """{key: {lr: [run names]}} -> {key: choice}, for the keys not chosen before; merged into STUDY/selection.json
    (earlier choices are kept, in the present format: selection_file). The dev losses, scored as the spec's
    `score` block says, in `processes` processes."""
    path = StudyDir(study_dir).selection_file
    chosen = read_selection(path)
    score = {**SCORE_DEFAULTS, **spec.plan.score}
    todo = {k: v for k, v in candidates.items() if k not in chosen}
    if todo:
        names = sorted({n for runs in todo.values() for lr_runs in runs.values() for n in lr_runs})
        loss_of = dev_losses(study_dir, names, score, processes)
        for key, runs in todo.items():
            chosen[key] = choice({lr: [loss_of[n] for n in lr_runs] for lr, lr_runs in runs.items()}, runs)
        atomic_write_json(path, chosen, indent=1)
    return chosen


def dev_loss_rows(study_dir: Path, shard: tuple, out: Path, names: list[str], dev_rows: int,
                  batch_size: int) -> None:
    """The dev loss of every `shard` (K, N)-th named run's final model (what the LR choice compares), one JSON row
    per run into `out` (run_sharded's part)."""
    k, n = shard
    torch.set_num_threads(1)  # one thread a process: the cores the training used
    cfg = RunDir(StudyDir(study_dir).run(names[0])).read_config()
    dev = score_sets(cfg, dev_rows)["dev"]
    rows = []
    for name in names[k::n]:
        loss = dev_loss(StudyDir(study_dir).run(name), dev, batch_size)
        rows.append({"name": name, "dev_loss": loss if math.isfinite(loss) else None})
    write_jsonl(out, rows)
