"""What a user sees while the C++ kernels build (normlab/kernels/build_progress.py), with a sleep for the build."""

import contextlib
import io
import time

import pytest

from normlab.kernels.build_progress import BuildProgress, build_dir, is_cached, seconds_building


def _build(seconds, announce_now, fail=False, **timing):
    stream = io.StringIO()
    with pytest.raises(RuntimeError) if fail else contextlib.nullcontext():
        with BuildProgress(announce_now, stream=stream, **timing):
            time.sleep(seconds)
            if fail:
                raise RuntimeError("g++ not found")
    return stream.getvalue().splitlines()


def test_a_build_says_what_why_how_long_and_how_to_skip_then_counts_then_ends():
    lines = _build(0.35, announce_now=True, every=0.1)
    assert "building NormLab's C++ CPU kernels" in lines[0] and "train.kernels=reference" in lines[0]
    # the measured times (docs/kernels.md), idle and with another job on the cores
    assert "Measured on 2 cores: 30 s with the cores idle, 60 s beside another build" in lines[0]
    assert any(line.startswith("normlab.kernels: still building (") for line in lines[1:-1])
    assert lines[-1].startswith("normlab.kernels: C++ kernels built in ")


def test_a_cached_build_prints_nothing_and_a_slow_one_speaks_after_the_grace_time():
    assert _build(0.01, announce_now=False, grace=1.0) == []
    lines = _build(0.3, announce_now=False, grace=0.05, every=10)
    assert "building NormLab's C++ CPU kernels" in lines[0] and "built in" in lines[-1]


def test_a_failed_build_says_it_falls_back():
    lines = _build(0.01, announce_now=True, fail=True)
    assert "failed" in lines[-1] and "reference" in lines[-1]


def test_only_the_first_local_process_speaks(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert _build(0.01, announce_now=True) == []


def test_the_cache_is_where_torch_builds_and_looking_creates_nothing(tmp_path, monkeypatch):
    import torch.utils.cpp_extension as cpp_extension

    name = "normlab_never_built_anywhere"
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(cpp_extension, "get_default_build_root", lambda: str(tmp_path / "default"))
    assert build_dir(name) == cpp_extension._get_build_directory(name, False)  # (which creates the folder)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert not is_cached(name) and not (tmp_path / name).exists()
    (tmp_path / name).mkdir()
    (tmp_path / name / f"{name}.so").write_bytes(b"")
    assert is_cached(name)


def test_a_lock_left_behind_is_named_while_waiting(tmp_path):
    lock = tmp_path / "lock"
    lock.write_text("")  # there before the load: another process's build, or a killed one's leftover
    stream = io.StringIO()
    with BuildProgress(announce_now=True, stream=stream, every=0.1, lock=str(lock)):
        time.sleep(0.35)
    assert f"for another process's build (its lock file {lock})" in stream.getvalue()
    quiet = io.StringIO()
    with BuildProgress(announce_now=True, stream=quiet, every=0.1, lock=str(tmp_path / "absent")):
        time.sleep(0.25)
    assert "still building" in quiet.getvalue() and "lock" not in quiet.getvalue()


def test_the_time_spent_building_is_counted_apart_and_a_cached_load_adds_nothing(monkeypatch):
    """What a run subtracts from its wall time to say its build apart ("completed in" names both)."""
    before = seconds_building()
    _build(0.01, announce_now=False, grace=1.0)  # a cached build's load
    assert seconds_building() == before
    _build(0.2, announce_now=True)
    monkeypatch.setenv("LOCAL_RANK", "1")  # a silent process built too
    _build(0.2, announce_now=True)
    assert 0.4 <= seconds_building() - before < 2.0
