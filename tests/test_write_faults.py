"""Writes the filesystem refuses (full disk, no permission, read-only): a checkpoint, final/, the run's records.
Each ends with one `error:` line (what, where, why, what to do) and exit code 3, leaves no half-written files,
keeps the last complete checkpoint, and the run then resumes to the weights of an uninterrupted run. An output
folder that cannot be written is refused before any data is loaded."""

import errno
import json
import os

import pytest
import torch
from transformers import PreTrainedTokenizerFast

import normlab.files.formats
from normlab.files.writes import WriteError, guarded_write
from normlab.tracking.metrics_jsonl import MetricsWriter
from normlab.train import run as train
from normlab.train.checkpointing import validate_checkpoint
from train_utils import REFERENCE, assert_same_weights, final_weights, losses, run_here, summary


def refuse(code: int, path) -> OSError:
    return OSError(code, os.strerror(code), str(path))


def checkpoint_20_disk_full(mp):
    """torch.save (the optimizer's file, after the weights) hits a full disk inside checkpoint step_20."""
    save = torch.save

    def failing_save(obj, f, *args, **kwargs):
        if ".tmp-step_20" in str(f):
            raise refuse(errno.ENOSPC, f)
        return save(obj, f, *args, **kwargs)

    mp.setattr(torch, "save", failing_save)


def final_no_permission(mp):
    """The tokenizer's files in final/ (after the weights) are refused."""
    save = PreTrainedTokenizerFast.save_pretrained

    def failing_save(self, directory, *args, **kwargs):
        if ".tmp-final" in str(directory):
            raise refuse(errno.EACCES, directory)
        return save(self, directory, *args, **kwargs)

    mp.setattr(PreTrainedTokenizerFast, "save_pretrained", failing_save)


def metrics_read_only(mp):
    """metrics.jsonl's filesystem turns read-only at step 25 (between two checkpoints)."""

    class ReadOnlyAfter25:
        def __init__(self, file):
            self.file = file

        def write(self, text):
            if json.loads(text)["step"] >= 25:
                raise refuse(errno.EROFS, self.file.name)
            return self.file.write(text)

        def __getattr__(self, name):
            return getattr(self.file, name)

    init = MetricsWriter.__init__

    def init_then_fail(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.file = ReadOnlyAfter25(self.file)

    mp.setattr(MetricsWriter, "__init__", init_then_fail)


def summary_disk_full(mp):
    """The disk is full when the finished run writes summary.json: the failure cannot be recorded there either."""
    write_text = normlab.files.formats.atomic_write_text

    def failing_write_text(path, text):
        if os.path.basename(path) == "summary.json":
            raise refuse(errno.ENOSPC, path)
        return write_text(path, text)

    mp.setattr(normlab.files.formats, "atomic_write_text", failing_write_text)


# (fault, what the error line names, the OS's reason, the newest complete checkpoint after it, summary written)
FAULTS = [
    (checkpoint_20_disk_full, "checkpoint step_20", "No space left on device (ENOSPC)", "step_10", True),
    (final_no_permission, "the final model", "Permission denied (EACCES)", "step_40", True),
    (metrics_read_only, "metrics.jsonl", "Read-only file system (EROFS)", "step_20", True),
    (summary_disk_full, "summary.json", "No space left on device (ENOSPC)", "step_40", False),
]


@pytest.mark.parametrize("fault,what,reason,kept,recorded", FAULTS, ids=[f[0].__name__ for f in FAULTS])
@pytest.mark.slow  # trains, fails, resumes and retrains for reference
def test_a_refused_write_is_one_line_and_the_run_resumes(fault, what, reason, kept, recorded, reference, tmp_path,
                                                         capsys):
    out = tmp_path / "run"
    with pytest.MonkeyPatch.context() as mp:
        fault(mp)
        assert run_here(out, *REFERENCE) == train.EXIT_WRITE_FAILED
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    line = errors[0]
    for words in (what, str(out), reason, f"the last complete checkpoint, {out / 'checkpoints' / kept}, is intact",
                  "train.resume=auto"):
        assert words in line, (words, line)
    assert ("free space" if "ENOSPC" in reason else "writable") in line

    # no half-written leftovers; the last complete checkpoint is intact
    assert not [p for p in out.rglob("*") if p.name.startswith(".tmp-") or p.name.endswith(".tmp")]
    validate_checkpoint(out / "checkpoints" / kept)
    if recorded:
        s = summary(out)
        assert s["status"] == "failed" and s["error"] == line.removeprefix("error: ")
        assert s["last_checkpoint"] == str(out / "checkpoints" / kept)
    else:
        assert not (out / "summary.json").exists()

    # once the cause is gone, the run continues to the weights and losses of an uninterrupted run
    assert run_here(out, *REFERENCE, "train.resume=auto") == 0
    assert summary(out)["status"] == "completed"
    assert_same_weights(final_weights(out), final_weights(reference))
    assert losses(out) == losses(reference)


def test_a_full_disk_behind_another_error_is_found_by_a_probe(tmp_path, monkeypatch):
    """torch's zip writer reports a full disk as `RuntimeError: ... unexpected pos`: the probe next to the file
    finds the reason; the half-written folder goes either way, and an error with the disk fine passes through."""
    partial = tmp_path / ".tmp-step_20"

    def fail(exc):
        partial.mkdir(exist_ok=True)
        (partial / "optimizer.bin").write_bytes(b"PK\x03\x04")
        with guarded_write("checkpoint step_20", tmp_path / "step_20", cleanup=lambda: _rmtree(partial)):
            raise exc

    with pytest.raises(RuntimeError, match="unexpected pos"):  # the disk is fine: not a write fault
        fail(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 7424 vs 7316"))
    assert not partial.exists()

    def disk_full(fd, data):
        raise refuse(errno.ENOSPC, fd)

    monkeypatch.setattr(os, "write", disk_full)
    with pytest.raises(WriteError) as e:
        fail(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 7424 vs 7316"))
    monkeypatch.undo()
    assert "checkpoint step_20" in str(e.value) and "No space left on device (ENOSPC)" in str(e.value)
    assert not partial.exists()

    # safetensors words the OS's error in its own message
    with pytest.raises(WriteError, match=r"Disk quota exceeded \(EDQUOT\)"):
        fail(Exception('Error while serializing: IoError(Os { code: 122, kind: QuotaExceeded, message: "..." })'))


def _rmtree(path):
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def test_an_output_dir_that_cannot_be_written_is_refused_before_any_data_is_loaded(tmp_path, monkeypatch, capsys):
    def no_data(*args, **kwargs):
        raise AssertionError("data was loaded")

    monkeypatch.setattr("normlab.train.run.load_tokenized", no_data)  # train.py runs normlab.train.run
    # a part of the path is a file
    (tmp_path / "a-file").write_text("")
    assert run_here(tmp_path / "a-file" / "run") == train.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "not a folder" in err[0], err
    assert str(tmp_path / "a-file") in err[0]

    # a folder without write permission (as root, permissions do not stop writes: the refusal is injected)
    def read_only(*args, dir=None, **kwargs):
        raise refuse(errno.EACCES, dir)

    monkeypatch.setattr("normlab.files.writes.tempfile.TemporaryFile", read_only)
    assert run_here(tmp_path / "new" / "run") == train.EXIT_WRITE_FAILED
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    for words in (f"create output_dir={tmp_path / 'new' / 'run'} in {tmp_path}", "Permission denied (EACCES)",
                  f"make {tmp_path} writable", "pick another output_dir"):
        assert words in err[0], (words, err[0])
    assert not (tmp_path / "new").exists()
