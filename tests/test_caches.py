"""The caches NormLab can rebuild (the trained tokenizer, the tokenized splits, the C++ kernel build): written
atomically, checked when read, and a damaged entry rebuilt with one warning naming it."""

import errno
import os
import shutil
import subprocess
import sys

import pytest
from datasets import Dataset, DatasetDict, load_from_disk
from transformers import PreTrainedTokenizerFast

import normlab.kernels.cpu
from normlab.config.loader import REPO_ROOT, load_config
from normlab.data.tokenizer import get_tokenizer, tokenize_splits
from normlab.files.cache import MANIFEST, folder_problem
from normlab.kernels.build_cache import build_dir

TEXTS = [f"sentence number {i} is {'good' if i % 2 else 'bad'} and {'long ' * (i % 7)}done" for i in range(200)]
DATA = load_config(overrides=["data.max_length=32"]).data  # sentence/label columns, no Hub tokenizer
VOCAB = 120


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NORMLAB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def warnings_in(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning: ")]


def truncate(path) -> None:
    """Half of the file, as a new file: one this process has memory-mapped keeps its pages (no SIGBUS here)."""
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data[: len(data) // 2])


def tokenizer_entry(cache):
    (entry,) = (cache / "tokenizers").iterdir()
    return entry


DAMAGE = {
    "truncated tokenizer.json": lambda entry: truncate(entry / "tokenizer.json"),
    "a file missing": lambda entry: (entry / "tokenizer_config.json").unlink(),
    "an unreadable manifest": lambda entry: truncate(entry / MANIFEST),
    "no manifest (an older entry) and a truncated tokenizer.json": lambda entry: (
        (entry / MANIFEST).unlink(), truncate(entry / "tokenizer.json")),
    "a changed vocabulary that still parses": lambda entry: (entry / "tokenizer.json").write_text(
        (entry / "tokenizer.json").read_text().replace('"vocab": {', '"vocab": {"zz": 119, ', 1)),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_a_damaged_tokenizer_cache_is_rebuilt_with_one_warning(damage, private_cache, capsys):
    first = get_tokenizer(DATA, VOCAB, TEXTS)
    entry = tokenizer_entry(private_cache)
    assert folder_problem(entry) is None and not warnings_in(capsys.readouterr().err)

    DAMAGE[damage](entry)
    again = get_tokenizer(DATA, VOCAB, TEXTS)
    warned = warnings_in(capsys.readouterr().err)
    assert len(warned) == 1 and str(entry) in warned[0] and "rebuilding" in warned[0], warned
    assert again.backend_tokenizer.to_str() == first.backend_tokenizer.to_str()
    assert folder_problem(entry) is None and [p.name for p in entry.parent.iterdir()] == [entry.name]

    get_tokenizer(DATA, VOCAB, TEXTS)  # rebuilt once: read from the cache from now on, quietly
    assert not warnings_in(capsys.readouterr().err)


def test_an_older_tokenizer_cache_entry_that_loads_is_kept_and_checked_from_then_on(private_cache, capsys):
    first = get_tokenizer(DATA, VOCAB, TEXTS)
    entry = tokenizer_entry(private_cache)
    (entry / MANIFEST).unlink()  # as written before manifests existed
    again = get_tokenizer(DATA, VOCAB, TEXTS)
    assert not warnings_in(capsys.readouterr().err) and (entry / MANIFEST).is_file()
    assert again.backend_tokenizer.to_str() == first.backend_tokenizer.to_str()
    truncate(entry / "tokenizer_config.json")
    get_tokenizer(DATA, VOCAB, TEXTS)
    assert "tokenizer_config.json has changed" in "".join(warnings_in(capsys.readouterr().err))


def test_a_tokenizer_cache_the_disk_refuses_leaves_nothing_and_the_run_goes_on(private_cache, monkeypatch, capsys):
    def disk_full(self, folder, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder))

    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", disk_full)
    tokenizer = get_tokenizer(DATA, VOCAB, TEXTS)
    assert tokenizer("sentence number 3")["input_ids"][0] == tokenizer.cls_token_id
    warned = warnings_in(capsys.readouterr().err)
    assert len(warned) == 1 and "No space left on device" in warned[0] and str(private_cache) in warned[0]
    assert list((private_cache / "tokenizers").iterdir()) == []  # no half-written entry


def test_a_damaged_tokenized_split_is_rebuilt_with_one_warning(tmp_path, capsys):
    # a dataset backed by files in tmp_path: datasets puts its map cache next to them
    Dataset.from_dict({"sentence": TEXTS, "label": [i % 2 for i in range(200)]}).save_to_disk(tmp_path / "ds")
    dsd = DatasetDict({"train": load_from_disk(str(tmp_path / "ds"))})
    # a fresh tokenizer per call, as in separate runs (tokenizing sets the backend's truncation, part of the key)
    first = tokenize_splits(dsd, get_tokenizer(DATA, VOCAB, TEXTS), DATA, "classification")["train"]
    cache_file = tmp_path / "ds" / os.path.basename(first.cache_files[0]["filename"])
    assert cache_file.name.startswith("cache-") and cache_file.is_file()
    capsys.readouterr()

    truncate(cache_file)
    again = tokenize_splits(dsd, get_tokenizer(DATA, VOCAB, TEXTS), DATA, "classification")["train"]
    warned = warnings_in(capsys.readouterr().err)
    assert len(warned) == 1 and str(cache_file) in warned[0] and "'train'" in warned[0], warned
    assert again.to_dict() == first.to_dict()

    assert again.cache_files == first.cache_files
    tokenize_splits(dsd, get_tokenizer(DATA, VOCAB, TEXTS), DATA, "classification")  # the rebuilt file is read quietly
    assert not warnings_in(capsys.readouterr().err)


def load_kernels(extensions) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), "PYTHONPATH": str(REPO_ROOT),
           "OMP_NUM_THREADS": "1"}
    script = "import normlab.kernels.cpu as cpu; cpu.register(); print('loaded')"
    return subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=900)


@pytest.mark.parametrize("recorded", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["recorded build", "unrecorded build"])
def test_a_truncated_kernel_build_is_relinked_with_one_warning(recorded, cpp, tmp_path):
    """What a build killed while linking leaves: loading it would crash the process (SIGBUS)."""
    name = normlab.kernels.cpu.extension_name()
    folder = tmp_path / "extensions" / name
    shutil.copytree(build_dir(name), folder)  # this checkout's build (the `cpp` fixture loaded it): no recompile
    if not recorded:  # killed before its first load
        (folder / MANIFEST).unlink(missing_ok=True)
    truncate(folder / f"{name}.so")

    result = load_kernels(tmp_path / "extensions")
    assert result.returncode == 0 and "loaded" in result.stdout, result.stderr[-2000:]
    warned = warnings_in(result.stderr)
    expected = "has changed" if recorded else "is cut short"
    assert len(warned) == 1 and str(folder) in warned[0] and expected in warned[0], warned
    result = load_kernels(tmp_path / "extensions")
    assert result.returncode == 0 and not warnings_in(result.stderr), result.stderr[-2000:]


HOLD_BUILD_LOCK = """
import sys, time
from pathlib import Path
from normlab.kernels.build_cache import loading
folder = Path(sys.argv[1])
with loading(folder):  # what a NormLab load does around torch's build, which creates its lock first
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "lock").touch()
    print("building", flush=True)
    time.sleep(float(sys.argv[2]))
    (folder / "lock").unlink()  # a build that finishes releases torch's lock
"""


def start_build(folder, seconds: float) -> subprocess.Popen:
    """A process that loads the kernels as NormLab does and builds for `seconds`, holding torch's build lock."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD_BUILD_LOCK, str(folder), str(seconds)], cwd=REPO_ROOT,
                            env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "building"
    assert (folder / "lock").exists()
    return proc


def fake_build(folder, calls: list):
    """torch.utils.cpp_extension.load's part in it: with its lock there it would wait until the lock goes."""
    def build_and_load(name, sources, extra_cflags):
        assert not (folder / "lock").exists(), "torch would wait on this lock for good"
        calls.append(name)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{name}.so").write_bytes(b"not ELF: loading is the check")
        return "module"
    return build_and_load


@pytest.mark.parametrize("killed", [True, False], ids=["builder killed", "builder alive"])
def test_a_build_lock_whose_builder_was_killed_is_removed_with_one_warning(killed, tmp_path, monkeypatch, capsys):
    from normlab.kernels.build_cache import load_checked

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    folder, source = tmp_path / "extensions" / "fake_ext", tmp_path / "fake.cpp"
    source.write_text("// the sources' digest is part of the cache check")
    builder = start_build(folder, seconds=60 if killed else 1)
    if killed:
        builder.kill()  # kill -9 mid-build: torch's lock stays behind
    builder.wait(timeout=60)
    calls = []
    assert load_checked(fake_build(folder, calls), "fake_ext", [str(source)], ["-O3"]) == "module"
    assert calls == ["fake_ext"] and not (folder / "lock").exists()
    warned = warnings_in(capsys.readouterr().err)
    if killed:
        assert len(warned) == 1 and str(folder / "lock") in warned[0] and "killed" in warned[0], warned
    else:  # a live build's lock is its own: the load waits its turn, then finds no lock to remove
        assert warned == []
