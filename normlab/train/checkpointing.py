"""Run-directory bookkeeping for train.py: atomic checkpoints, exact resume, the final model, a failed write in
summary.json. How checkpoints stay whole: docs/architecture.md, "Checkpoints and refused writes"."""

import errno
import os
import random
import re
import shutil
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np
import torch

from normlab.files.cache import folder_index, short
from normlab.files.formats import atomic_write_json, read_json
from normlab.files.writes import WriteError, guarded_write
from normlab.run_dir import RunDir
from normlab.train.run_summary import resume_command

TRAINER_STATE = "trainer_state.json"
STATE_FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint that is missing, half-written or corrupted; the message names it and what to do."""


def _fsync_dir(path: Path) -> None:
    with suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a fully written `tmp` directory to `final`, replacing an older `final` (rename is atomic; a
    directory cannot be renamed over a non-empty one, so the old one is first moved aside, then deleted)."""
    old = final.with_name(f".old-{final.name}")
    shutil.rmtree(old, ignore_errors=True)  # left by a kill during an earlier replace
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_dir(final: Path, what: str):
    """Yields an empty temporary folder next to `final`, which becomes `final` once the block completes. A
    refused write removes the temporary folder and raises WriteError(what); an older `final` stays as it was."""
    tmp = final.with_name(f".tmp-{final.name}")
    remove = lambda: shutil.rmtree(tmp, ignore_errors=True)  # noqa: E731 - used twice below, one line
    with guarded_write(what, final, cleanup=remove):
        remove()  # left by a kill during an earlier write
        tmp.mkdir(parents=True)
        yield tmp
        replace_dir(tmp, final)


def checkpoints_root(output_dir) -> Path:
    return RunDir(output_dir).checkpoints


def list_checkpoints(output_dir) -> list[tuple[int, Path]]:
    """(step, path) of every `step_N` directory (valid or not), oldest first."""
    found = ((_STEP_DIR.match(p.name), p) for p in checkpoints_root(output_dir).glob("step_*"))
    return sorted((int(m.group(1)), p) for m, p in found if m and p.is_dir())


def validate_checkpoint(path) -> dict:
    """The checkpoint's trainer state, or CheckpointError saying what is wrong with it."""
    path = Path(path)
    fix = "delete it, or resume from an earlier checkpoint with train.resume=<output_dir>/checkpoints/step_N"
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist; give train.resume=auto or an existing "
                              f"checkpoints/step_N")
    state = read_json(path / TRAINER_STATE)
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT or "files" not in state:
        raise CheckpointError(f"checkpoint {path} is half-written or corrupted ({TRAINER_STATE} missing or "
                              f"unreadable); {fix}")
    for name, size in state["files"].items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing; {fix}")
        if f.stat().st_size != size:
            raise CheckpointError(
                f"checkpoint {path} is corrupted: {name} has {f.stat().st_size} bytes, {size} were written; {fix}")
    return state


def find_latest_checkpoint(output_dir) -> tuple[Path | None, list[str]]:
    """The newest valid checkpoint under output_dir (or None), and a message per invalid newer one skipped."""
    skipped = []
    for _, path in reversed(list_checkpoints(output_dir)):
        try:
            validate_checkpoint(path)
            return path, skipped
        except CheckpointError as e:
            skipped.append(f"skipping {e}")
    return None, skipped


def resolve_resume(resume, output_dir) -> tuple[Path | None, list[str]]:
    """train.resume -> (checkpoint path or None, warnings). `auto`: newest valid checkpoint in output_dir (None
    on a fresh run); a path: that checkpoint, or the newest valid one of a run directory given instead."""
    if resume is None:
        return None, []
    if resume == "auto":
        return find_latest_checkpoint(output_dir)
    path = Path(resume)
    if not (path / TRAINER_STATE).exists() and checkpoints_root(path).is_dir():  # a run directory
        found, skipped = find_latest_checkpoint(path)
        if found is None:
            raise CheckpointError(f"train.resume={resume}: no valid checkpoint under {checkpoints_root(path)}; "
                                  + "; ".join(skipped))
        return found, skipped
    validate_checkpoint(path)
    return path, []


def capture_rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def mid_epoch_rng(batches_in_epoch: int, epoch_length: int) -> dict | None:
    """Call right after `load_checkpoint`: the restored RNG state, to put back once the loader that skips the
    consumed batches has drawn its base seed (`restore_after_first`), as the uninterrupted run drew it before this
    checkpoint; None at an epoch boundary, where the uninterrupted run starts a loader too."""
    return capture_rng_state() if 0 < batches_in_epoch < epoch_length else None


def restore_after_first(batches, rng_state: dict | None):
    """`batches`, with `rng_state` (from mid_epoch_rng) restored as soon as the first batch is drawn."""
    for i, batch in enumerate(batches):
        if i == 0 and rng_state is not None:
            restore_rng_state(rng_state)
        yield batch


def save_checkpoint(accelerator, output_dir, step: int, trainer_state: dict, keep: int, model_files=None,
                    protect: int | None = None) -> Path:
    """Write checkpoints/step_{step} atomically and keep the newest `keep`, and the checkpoint of step `protect`
    (the best evaluation) whatever `keep` says. Collective: every process saves its own RNG state.
    `model_files(folder)`, when given, writes what makes the checkpoint a model directory besides accelerate's
    model.safetensors (main process). A refused write removes the half-written folder and raises WriteError."""
    root = checkpoints_root(output_dir)
    final = root / f"step_{step}"
    tmp = root / f".tmp-step_{step}"
    with guarded_write(f"checkpoint step_{step}", final, cleanup=lambda: shutil.rmtree(tmp, ignore_errors=True)):
        if accelerator.is_main_process:
            for stale in root.glob(".tmp-step_*"):
                shutil.rmtree(stale, ignore_errors=True)  # left by a kill during an earlier save
        accelerator.wait_for_everyone()
        tmp.mkdir(parents=True, exist_ok=True)
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            if model_files is not None:
                model_files(tmp)
            sizes = folder_index(tmp, TRAINER_STATE, describe=lambda f: f.stat().st_size)
            state = {"format": STATE_FORMAT, **trainer_state, "files": sizes}
            atomic_write_json(tmp / TRAINER_STATE, state)  # written last: its presence marks a complete checkpoint
            replace_dir(tmp, final)
        # Keep the newest `keep` up to this step. Newer ones belong to a timeline abandoned by resuming from an
        # older checkpoint (metrics.jsonl was rewound too), so they go.
        checkpoints = list_checkpoints(output_dir)
        older = [p for s, p in checkpoints if s <= step]
        newer = [p for s, p in checkpoints if s > step]
        for old in older[:-keep] + newer:
            if old.name != f"step_{protect}":
                shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def record_write_failure(output_dir, error: WriteError, num_processes: int = 1, **fields) -> None:
    """After a refused write: name the last complete checkpoint and the command that continues the run in `error`,
    and record the failure in summary.json (status failed, `fields`, the error) if the filesystem still takes it.
    Main process only."""
    last, _ = find_latest_checkpoint(output_dir)
    error.kept, error.then = last, f"continue the run: {resume_command(output_dir, num_processes)}"
    summary = {"status": "failed", **fields, "last_checkpoint": str(last) if last else None, "error": str(error),
               "failed_write": {"what": error.what, "path": str(error.path),
                                "errno": errno.errorcode.get(error.os_error.errno), "reason": error.reason}}
    with suppress(WriteError):  # the same full disk, most likely; the error line still says everything
        RunDir(output_dir).write_summary(summary)


def load_checkpoint(accelerator, path) -> dict:
    """Restore model, optimizer, scheduler and RNG from a checkpoint; returns its trainer state."""
    state = validate_checkpoint(path)
    try:
        accelerator.load_state(str(path))
    except Exception as e:  # a size mismatch, a truncated tensor file, an unpicklable RNG file...
        raise CheckpointError(
            f"checkpoint {path} could not be loaded ({short(e, 300)}); it is corrupted or was written by a "
            f"different model config; resume from another checkpoint or start a new output_dir") from e
    return state

