"""What one device call copies to the lent GPU machine (scripts/gpu/gpu_prepare.py's payload(): the checkout's
tracked and untracked-not-ignored files, shared/, the carried .whl and .gpudata): it must stay under the limit
whatever is committed, or the check cannot run the day a GPU is lent."""

import subprocess

import pytest

from module_loader import GPU_TOOLS, load_module
from train_utils import REPO

gpu_prepare = load_module("gpu_prepare", GPU_TOOLS / "gpu_prepare.py")


def test_the_device_call_fits_with_this_checkout():
    """Fails when this checkout (a new study's records, say) would make the call copy more than the limit, 4 MiB
    under the device's: where .whl and .gpudata are not prepared, each counts at the allowance preparing holds it to."""
    measured = gpu_prepare.payload(REPO)
    assert measured.total <= gpu_prepare.PAYLOAD_LIMIT_MIB < gpu_prepare.DEVICE_LIMIT_MIB, str(measured)
    assert not measured.problems(), str(measured)


def _git(cwd, *args):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


def test_payload_counts_what_the_device_copies(tmp_path):
    """Tracked and untracked files, not ignored ones; shared/ even when ignored; a carried folder's files, or its
    allowance where it is not there."""
    _git(tmp_path, "init", "-q")
    (tmp_path / ".gitignore").write_text("ignored.bin\nshared/\n.whl/\n.gpudata/\n")
    for name, size in {"tracked.txt": 2**20, "untracked.txt": 2**19, "ignored.bin": 2**22, "shared/a/b.bin": 2**18,
                       ".whl/x-1-py3-none-any.whl": 2**20}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"x" * size)
    _git(tmp_path, "add", ".gitignore", "tracked.txt")
    gitignore = len((tmp_path / ".gitignore").read_bytes()) / 2**20
    measured = gpu_prepare.payload(tmp_path)
    assert measured.parts == pytest.approx({"tree": 1 + 0.5 + 0.25 + gitignore, ".whl": 1,
                                            ".gpudata": gpu_prepare.CARRY_ALLOWANCE_MIB[".gpudata"]})
    assert measured.allowed == (".gpudata",) and "not prepared" in str(measured)
    assert gpu_prepare.device_files(tmp_path) == [".gitignore", "shared/a/b.bin", "tracked.txt", "untracked.txt"]
    elsewhere = tmp_path / "data"  # --data: the data folder prepared in another place
    (elsewhere / "sst2").mkdir(parents=True)
    (elsewhere / "sst2" / "train.parquet").write_bytes(b"x" * 2**20)
    assert gpu_prepare.payload(tmp_path, {".gpudata": elsewhere}).parts[".gpudata"] == 1


def test_an_oversized_payload_is_refused_in_one_line(monkeypatch, capsys):
    parts = {"tree": 14.9, ".whl": 47.9, ".gpudata": 1.9}  # as when pyarrow's wheel travelled (46.6 MiB)
    problems = gpu_prepare.Payload(parts).problems()
    assert len(problems) == 2 and problems[0].startswith(".whl holds 47.9 MiB, over its allowance of 3 MiB")
    assert problems[1].startswith("64.7 MiB to copy is over 60 MiB")
    monkeypatch.setattr(gpu_prepare, "PAYLOAD_LIMIT_MIB", 0.001)
    assert gpu_prepare.main(["--payload"]) == 1
    out, err = capsys.readouterr()
    assert out.startswith("payload ") and err.count("\n") == 1 and err.startswith("error: ")
