"""Each arm at its own best learning rate, chosen on the dev split (never on the split the study reports): the
lowest mean dev loss over the sweep's seeds; a diverged or crashed run counts as infinitely bad. The choice is
written once to STUDY/selection.json and reused by every later invocation (docs/studies.md).
"""

import math
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from itertools import repeat
from pathlib import Path

import numpy as np
import torch

from normlab.files.formats import atomic_write_json
from normlab.run_dir import RunDir
from normlab.study.engines import read_status
from normlab.study.rules import choose_lrs
from normlab.study.scoring import SCORE_DEFAULTS, score_run, score_sets
from normlab.study.selection_file import lr_rows, read_selection


def dev_loss(run_dir: Path, dev, batch_size: int) -> float:
    """Mean cross-entropy of the run's final model on the dev rows (length-sorted batches, running statistics)."""
    if read_status(run_dir) != "completed" or not RunDir(run_dir).has_final():
        return math.inf
    loss = score_run(run_dir, {"dev": dev}, False, batch_size)[0]["dev/sorted/running"]["loss"]
    return float(loss) if loss is not None else math.inf  # the loss is None when it is not finite


def best_lr(dev_loss_by_lr: dict) -> float:
    """The LR with the lowest mean dev loss over seeds ({lr: [loss per seed]}); ties go to the smaller LR."""
    return min(sorted(dev_loss_by_lr), key=lambda lr: float(np.mean(dev_loss_by_lr[lr])))


def choice(losses: dict, runs: dict | None = None) -> dict:
    """{lr: [dev loss per seed]} (and {lr: [run names]}) -> the record selection.json keeps: the best LR; with two
    LRs or more also the runner-up, the gap between them, the per-seed SD and whether they are a near tie
    (rules.choose_lrs); and `by_lr`, each LR's mean dev loss, every seed's loss and its runs (selection_file)."""
    out = {"lr": best_lr(losses)}
    if len(losses) >= 2:
        picked = choose_lrs(losses)
        out.update({k: picked[k] for k in ("runner_up", "near_tie")})
        # a diverged seed makes the gap or the SD infinite or undefined: null in JSON
        out.update({k: round(picked[k], 5) if math.isfinite(picked[k]) else None for k in ("gap", "seed_sd")})
    tables = {"dev_loss": {lr: round(float(np.mean(v)), 5) for lr, v in losses.items()},
              "dev_loss_by_seed": {lr: [round(float(x), 5) if math.isfinite(x) else None for x in v]
                                   for lr, v in losses.items()}}
    out["by_lr"] = lr_rows({**tables, **({"runs": runs} if runs else {})})
    return out


def dev_losses(run_dirs: list[Path], dev, batch_size: int, processes: int = 1) -> list[float]:
    """dev_loss of each run, in `processes` processes at once (one thread each, the cores the training used; each
    loss is computed alone, so how many processes changes nothing but the time)."""
    if processes <= 1 or len(run_dirs) <= 1:
        torch.set_num_threads(1)
        return [dev_loss(d, dev, batch_size) for d in run_dirs]
    dev = tuple(list(column) for column in dev)  # plain lists: sent to every process
    with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn"),
                             initializer=torch.set_num_threads, initargs=(1,)) as pool:
        return list(pool.map(dev_loss, run_dirs, repeat(dev), repeat(batch_size)))


def select(study_dir: Path, candidates: dict, score: dict, processes: int = 1) -> dict:
    """{key: {lr: [run names]}} -> {key: choice}, for the keys not chosen before; merged into STUDY/selection.json
    (earlier choices are kept, in the present format: selection_file). The dev losses in `processes` processes."""
    path = study_dir / "selection.json"
    chosen = read_selection(path)
    score = {**SCORE_DEFAULTS, **score}
    todo = {k: v for k, v in candidates.items() if k not in chosen}
    if todo:
        names = [n for runs in todo.values() for names in runs.values() for n in names]
        cfg = RunDir(study_dir / "runs" / names[0]).read_config()
        dev = score_sets(cfg, score["dev_rows"])["dev"]
        loss_of = dict(zip(names, dev_losses([study_dir / "runs" / n for n in names], dev, score["batch_size"],
                                             processes)))
        for key, runs in todo.items():
            chosen[key] = choice({lr: [loss_of[n] for n in names] for lr, names in runs.items()}, runs)
        atomic_write_json(path, chosen, indent=1)
    return chosen
