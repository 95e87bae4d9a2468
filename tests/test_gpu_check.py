"""scripts/gpu/gpu_check.sh rehearsed on the CPU under the GPU machine's conditions (tests/gpu_image_env.py: the image's
package set, NormLab not installed, python3 only, the returned folder $OUT), its plan (order, time budget, the
Triton tests it selects), gpu_check.py's LayerNorm judgement, and scripts/gpu/gpu_prepare.py: what it carries, how it
keeps the wheels it has, and the commit it records."""

import inspect
import json
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import gpu_image_env
from gpu_image_env import gpu_prepare
from module_loader import GPU_TOOLS, load_module
from train_utils import REPO, env

gpu_check = load_module("gpu_check", GPU_TOOLS / "gpu_check.py")

# what the image lacks of what the check imports, and fsspec, which datasets bounds from above (the image's version
# unknown)
CARRIED = {"datasets", "dill", "multiprocess", "omegaconf", "fsspec"}
BUDGET_S = 480  # one device call's sections, by estimate (docs/gpu.md)


def run_check(tmp_path, with_wheels: bool, *args, **extra_env):
    e = {**gpu_image_env.image_env(env(), tmp_path, with_wheels), **extra_env}
    return subprocess.run(["bash", "scripts/gpu/gpu_check.sh", "--cpu", *args], cwd=REPO, env=e, capture_output=True,
                          text=True, timeout=900)


def summary_lines(tmp_path) -> dict:
    """{section: ok or FAIL} from the returned summary.txt (its first line, the source, left out)."""
    lines = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert lines[0].startswith("source: commit ")
    return {line.split()[0]: line.split()[1] for line in lines[1:]}


def report(tmp_path, name: str):
    """A file of the returned archive (the one file a caller unpacks)."""
    with tarfile.open(tmp_path / "out" / "gpu_check_report.tar.gz") as tar:
        return tar.extractfile(f"report/{name}").read().decode()


def gpu_plan() -> list[tuple[str, int, int, list[str]]]:
    """(section, estimate s, limit s, command) of the device call, in the order it runs them."""
    out = subprocess.run(["bash", "scripts/gpu/gpu_check.sh", "--plan"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    rows = [line.split("\t") for line in out.splitlines()]
    return [(name, int(est), int(limit), shlex.split(cmd)) for name, est, limit, cmd in rows]


def test_the_device_call_runs_every_section_in_order_within_its_budget():
    plan = gpu_plan()
    names = [name for name, *_ in plan]
    steps = [n for n in names if n.startswith("steps-") and n != "steps-summary"]
    assert [s.rsplit("-", 1)[1] for s in steps] == ["single_gpu_bf16", "single_gpu_fp16", "multi_gpu", "fsdp"]
    assert names == ["wheels", "environment", "triton", "kernels", *steps, "steps-summary", "ln-bench",
                     "default-epoch", "default-epoch-summary", "bench"]
    assert sum(est for _, est, _, _ in plan) <= BUDGET_S
    assert all(0 < est <= limit for _, est, limit, _ in plan)
    kernels = dict((name, cmd) for name, _, _, cmd in plan)["kernels"]
    assert kernels[kernels.index("--columns") + 1:kernels.index("--out")] == ["128", "1000", "4096", "8192"]


def test_the_gpu_mode_triton_tests_are_the_compiled_paths_only():
    """Triton 3.6's interpreter fails under NumPy >= 2.4 (the image's): on the GPU the triton section runs every
    test of the file except the interpreter's (CI runs those), which proves nothing about the GPU anyway."""
    cmd = dict((name, cmd) for name, _, _, cmd in gpu_plan())["triton"]
    pytest_args = cmd[cmd.index("pytest") + 1:]
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", *pytest_args], cwd=REPO,
                         env=env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    selected = {line.split("::")[1].split("[")[0] for line in out.stdout.splitlines() if "::" in line}
    module = load_module("triton_layer_norm_tests", REPO / "tests" / "test_triton_layer_norm.py")
    tests = {n: f for n, f in vars(module).items() if n.startswith("test_") and callable(f)}
    interpreter = {n for n, f in tests.items() if "interpreted" in inspect.signature(f).parameters}
    assert interpreter and selected == set(tests) - interpreter
    assert {"test_kernels_compile_for_hopper", "test_cuda_backend_against_torch"} <= selected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_layernorm_check_passes_the_kernels_and_catches_wrong_ones(restore_cpu_backend, monkeypatch, dtype):
    """The GPU's kernels check, on CPU at small shapes: the reference kernels pass at every dtype; a LayerNorm whose
    bias gradient is 10% off, or whose eps is 100 times too large, is caught."""
    monkeypatch.setattr(gpu_check, "LN_DTYPES", (dtype,))
    small = {"device": torch.device("cpu"), "columns": (128, 1000), "rows": (2, 13), "kernels": "reference"}
    rows = gpu_check.check_layernorm(**small)
    assert [r["ok"] for r in rows] == [True] * 3 and rows[0]["backend"] == "reference"
    assert {r["dtype"] for r in rows[1:]} == {dtype}

    def bias_grad_off(x, w, b):
        return gpu_check.torch_layer_norm(x, w, b) + (0.1 * (b - b.detach())).to(x.dtype)

    def eps_off(x, w, b):
        return F.layer_norm(x.float(), x.shape[-1:], w, b, 1e-3).to(x.dtype)

    for wrong, quantity in ((bias_grad_off, "dbias"), (eps_off, "y")):
        rows = gpu_check.check_layernorm(**small, ours=wrong)[1:]
        if wrong is bias_grad_off or dtype == "float32":  # eps 1e-3 moves y by ~1e-4: below a bf16/fp16 unit
            assert not any(r["ok"] for r in rows), (wrong.__name__, rows)
            assert all(r["max_abs_err"]["ours"][quantity] > r["bound"][quantity] for r in rows)


def test_loads_back_finds_a_final_model_that_from_pretrained_would_load_wrong(tmp_path):
    from safetensors.torch import load_file, save_file

    from model import NormLabConfig, NormLabForSequenceClassification

    config = NormLabConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=32, norm="powernorm", num_labels=2, pad_token_id=0)
    NormLabForSequenceClassification(config).save_pretrained(tmp_path)
    assert gpu_check.loads_back(tmp_path) is True
    tensors = load_file(tmp_path / "model.safetensors")
    name = next(k for k in tensors if k.endswith("running_psi2"))  # a buffer a sharded save could leave out
    save_file({k: v for k, v in tensors.items() if k != name}, tmp_path / "model.safetensors", {"format": "pt"})
    problem = gpu_check.loads_back(tmp_path)
    assert problem.startswith("from_pretrained: {'missing_keys': ") and name in problem


def test_prepare_carries_exactly_what_the_image_lacks():
    pins = gpu_prepare.plan()
    # not pyarrow (47 MiB), pandas, python-dateutil, xxhash: the image has them; each travels where it lacks one
    assert set(pins) == CARRIED
    for lacking in ("pandas", "pyarrow"):
        assert gpu_prepare.plan(gpu_prepare.image_packages() - {lacking}).keys() == CARRIED | {lacking}
    cmd = gpu_prepare.pip_download_command(pins, REPO / ".whl")
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and "--only-binary=:all:" in cmd
    assert "manylinux2014_x86_64" in cmd and "--no-deps" in cmd
    assert sorted(a.split("==")[0] for a in cmd if "==" in a) == sorted(CARRIED)  # one version each


def test_prepare_stops_on_a_package_neither_on_the_image_nor_here(monkeypatch):
    real = gpu_prepare.md.distribution

    def distribution(name):
        if name == "omegaconf":
            raise gpu_prepare.md.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(gpu_prepare.md, "distribution", distribution)
    with pytest.raises(SystemExit, match=r"^error: neither on the GPU image nor installed here: omegaconf \(needed "
                                         r"by the check\); install"):
        gpu_prepare.plan()


def _fake_download(monkeypatch, code: str):
    """pip download replaced by `code` (Python; argv[1] is the folder to download into)."""
    monkeypatch.setattr(gpu_prepare, "pip_download_command", lambda pins, dest: [sys.executable, "-c", code,
                                                                                  str(dest)])


def test_prepare_keeps_the_wheels_it_cannot_replace(tmp_path, monkeypatch):
    wheels = tmp_path / ".whl"
    wheels.mkdir()
    old = wheels / "omegaconf-2.4.0-py3-none-any.whl"
    old.write_bytes(b"old")
    with pytest.raises(SystemExit, match="^error: nothing to carry"):
        gpu_prepare.download({}, wheels)  # e.g. a Python without the check's packages
    _fake_download(monkeypatch, "import sys; sys.exit(1)")
    with pytest.raises(SystemExit, match="^error: pip download failed"):
        gpu_prepare.download({"omegaconf": "2.4.0"}, wheels)
    _fake_download(monkeypatch, "import sys, pathlib; (pathlib.Path(sys.argv[1]) / 'x-1-py3-none-any.whl').touch()")
    with pytest.raises(SystemExit, match="do not match the plan"):
        gpu_prepare.download({"omegaconf": "2.4.0"}, wheels)
    assert sorted(wheels.iterdir()) == [old] and old.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".whl"]  # no download folder left behind
    _fake_download(monkeypatch, "import sys, pathlib; (pathlib.Path(sys.argv[1]) / 'omegaconf-9-py3-none-any.whl')"
                                ".write_bytes(b'new')")
    assert gpu_prepare.download({"omegaconf": "9"}, wheels) == [wheels / "omegaconf-9-py3-none-any.whl"]
    assert sorted(p.name for p in wheels.iterdir()) == ["omegaconf-9-py3-none-any.whl"]


def test_prepare_runs_from_a_plain_checkout(tmp_path):
    """NormLab not installed (its editable install here hidden), started from another folder: the data copy and the
    source line still work."""
    e = gpu_image_env.image_env(env(), tmp_path, with_wheels=True)
    path = str(GPU_TOOLS / "gpu_prepare.py")
    code = (f"import importlib.util as u, pathlib; s = u.spec_from_file_location('p', {path!r}); "
            "m = u.module_from_spec(s); s.loader.exec_module(m); print(m.copy_data(pathlib.Path('data')))")
    proc = subprocess.run(["python3", "-c", code], cwd=tmp_path, env=e, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {p.suffix for p in (tmp_path / "data" / "sst2").iterdir()} == {".parquet"}
    proc = subprocess.run(["python3", str(GPU_TOOLS / "gpu_prepare.py"), "--source", "data"], cwd=tmp_path, env=e,
                          capture_output=True, text=True, timeout=120)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert proc.returncode == 0 and proc.stdout.startswith(f"commit {head} ("), proc.stdout + proc.stderr


def test_the_report_names_the_commit_prepared(tmp_path):
    """gpu_prepare.py's source record travels in .gpudata (no .git on the device): summary.txt's first line and the
    environment log name its commit, and whether the tree is still the one prepared."""
    record = gpu_prepare.source_record()
    status = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout
    assert record["dirty"] == bool(status.strip()) and len(record["commit"]) == 40
    assert "tree as prepared" in gpu_prepare.describe_source(record)
    assert "TREE CHANGED" in gpu_prepare.describe_source({**record, "files": record["files"][1:]})
    data = tmp_path / "data"
    data.mkdir()
    (data / gpu_prepare.SOURCE).write_text(json.dumps(record))
    proc = run_check(tmp_path, True, GPU_CHECK_SECTIONS="environment", GPU_CHECK_DATA=str(data))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    first = (tmp_path / "out" / "summary.txt").read_text().splitlines()[0]
    assert first.startswith(f"source: commit {record['commit']} (") and "tree as prepared" in first
    assert first[len("source: "):] in report(tmp_path, "logs/environment.log")
    assert summary_lines(tmp_path) == {"environment": "ok"}


def test_a_spent_budget_reports_every_section_not_run_in_order(tmp_path):
    proc = run_check(tmp_path, True, GPU_CHECK_BUDGET_S="5")
    assert proc.returncode == 1
    lines = (tmp_path / "out" / "summary.txt").read_text().splitlines()[1:]
    assert [line.split()[0] for line in lines] == ["environment", "triton", "kernels",
                                                   "steps-powernorm-single_gpu_bf16", "steps-summary", "ln-bench",
                                                   "default-epoch", "default-epoch-summary", "bench"]
    assert all("not run: the 5s budget is spent" in line for line in lines)


def _ended(pid: int) -> bool:
    """Gone, or a zombie (a container's first process may never reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_ended(pid: int, seconds: float = 5) -> bool:
    for _ in range(int(seconds / 0.1)):
        if _ended(pid):
            return True
        time.sleep(0.1)
    return _ended(pid)


@pytest.mark.parametrize("launcher", ["returns", "hangs"])
def test_a_section_leaves_no_process_running(tmp_path, launcher):
    """torchrun starts each worker in a session of its own (torch.distributed.elastic's SubprocessHandler), out of
    reach of timeout's signals to its process group. A fake launcher does the same with a worker that ignores TERM,
    then returns (exit 3) or itself ignores TERM until its section times out and timeout kills it: either way
    run_section.sh kills the worker with its section, and leaves a process outside the section alone."""
    pidfile = tmp_path / "worker.pid"
    script = (f"trap '' TERM; setsid bash -c 'echo $$ > {pidfile}; exec sleep 300' & "
              f"while [ ! -s {pidfile} ]; do sleep 0.05; done; " + ("exit 3" if launcher == "returns" else "sleep 300"))
    outsider = subprocess.Popen(["sleep", "300"])
    try:
        if launcher == "returns":  # the leak itself: plain timeout leaves the worker running
            assert subprocess.run(["timeout", "60", "bash", "-c", script], timeout=60).returncode == 3
            stray = int(pidfile.read_text())
            assert not _ended(stray)
            subprocess.run(["kill", "-KILL", str(stray)])
            pidfile.unlink()
        proc = subprocess.run(["bash", "scripts/gpu/run_section.sh", "1", "bash", "-c", script], cwd=REPO,
                              env={**env(), "GPU_CHECK_KILL_AFTER_S": "1"}, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == (3 if launcher == "returns" else 137), proc.stderr
        worker = int(pidfile.read_text())
        assert _wait_ended(worker) and f"killed 1 process(es) the section left running: {worker}" in proc.stderr
        assert not _ended(outsider.pid)
    finally:
        outsider.kill()
        outsider.wait()


def test_run_section_passes_the_exit_status_and_refuses_a_bad_limit():
    run = ["bash", "scripts/gpu/run_section.sh"]
    done = subprocess.run([*run, "5", "bash", "-c", "exit 4"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 4 and done.stderr == ""
    bad = subprocess.run([*run, "5s", "true"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error: usage: ") and bad.stderr.count("\n") == 1


def test_prepare_evaluates_markers_for_the_image(monkeypatch):
    """A requirement for another platform, an extra or an older Python never comes along; one for the image does."""
    requires = {"root": ["tzdata; sys_platform == 'win32'", "linuxonly; sys_platform == 'linux'",
                         "opt; extra == 'cli'", "backport; python_version < '3.8'", "plain>=1"],
                "linuxonly": [], "plain": [], "tzdata": [], "opt": [], "backport": []}

    class Dist:
        def __init__(self, name):
            self.version, self.requires = "1.0", requires[name]

    def distribution(name):
        if name not in requires:
            raise gpu_prepare.md.PackageNotFoundError(name)
        return Dist(name)

    monkeypatch.setattr(gpu_prepare.md, "distribution", distribution)
    assert set(gpu_prepare.requirement_closure(["root"])) == {"root", "linuxonly", "plain"}


@pytest.mark.slow  # runs the check script for real
def test_rehearsal_under_the_image_package_set(tmp_path):
    proc = run_check(tmp_path, with_wheels=True,
                     GPU_CHECK_SECTIONS="environment triton kernels steps ln-bench epoch")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert summary_lines(tmp_path) == {name: "ok" for name in (
        "environment", "triton", "kernels", "steps-powernorm-single_gpu_bf16", "steps-summary", "ln-bench",
        "default-epoch", "default-epoch-summary")}
    # what the device returns: two files; the checkpoints stay in the work folder
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu_check_report.tar.gz", "summary.txt"]
    assert list((tmp_path / "work" / "runs").rglob("model.safetensors"))
    kernels = json.loads(report(tmp_path, "kernels.json"))["checks"]
    assert {c["check"] for c in kernels} == {"fast_backend_registered", "custom_layernorm_vs_float64",
                                             "fully_padded_row_finite"}
    assert all(c["ok"] for c in kernels)
    assert {(c["dtype"], c["shape"][-1]) for c in kernels if c["check"] == "custom_layernorm_vs_float64"} == {
        (d, n) for d in ("float32", "bfloat16", "float16") for n in (128, 1000)}
    ln = json.loads(report(tmp_path, "ln_bench.json"))
    assert ln["copy_GBps"] > 0 and {(r["impl"], r["dtype"]) for r in ln["rows"]} == {
        (i, d) for i in ("torch", "normlab") for d in ("float32", "bfloat16")}
    assert all(set(r["max_abs_err"]) == {"y", "dx", "dweight", "dbias"} for r in ln["rows"])
    assert all(r["ok"] for r in ln["rows"] if r["impl"] == "normlab")
    (steps,) = json.loads(report(tmp_path, "steps.json"))
    assert steps["status"] == "completed" and steps["steps"] == 2
    assert steps["running_stats_dtypes"] == ["F32"]  # trained under bf16, saved float32
    assert steps["loads_back"] is True  # final/ through from_pretrained: every tensor in place, as saved
    (epoch,) = json.loads(report(tmp_path, "default_epoch.json"))
    assert epoch["status"] == "completed" and epoch["wall_time_s"] > 0 and epoch["tokens_per_s_median"] > 0
    triton_log = report(tmp_path, "logs/triton.log")
    assert " passed" in triton_log and " deselected" in triton_log  # the interpreter's tests: CI runs them


@pytest.mark.slow  # runs the check script for real
def test_without_the_wheels_the_kernel_sections_still_run(tmp_path):
    """The image alone (no omegaconf, no datasets): the training steps fail, the LayerNorm sections before them do
    not, and the report still comes back."""
    proc = run_check(tmp_path, with_wheels=False, GPU_CHECK_SECTIONS="ln-bench steps")
    assert proc.returncode == 1
    lines = summary_lines(tmp_path)
    assert lines["ln-bench"] == "ok" and lines["steps-powernorm-single_gpu_bf16"] == "FAIL"
    assert "omegaconf" in report(tmp_path, "logs/steps-powernorm-single_gpu_bf16.log")
    (tmp_path / "bench").mkdir()
    e = gpu_image_env.image_env(env(), tmp_path / "bench", with_wheels=False)
    e["PYTHONPATH"] += f":{REPO}"  # as gpu_check.sh runs it: NormLab from the checkout, not installed
    bench = subprocess.run(["python3", "scripts/bench.py", "--layernorm-only", "--quick", "--device", "cpu",
                            "--repeats", "1", "--json"], cwd=REPO, env=e, capture_output=True, text=True, timeout=600)
    assert bench.returncode == 0, bench.stderr[-2000:]
    assert json.loads(bench.stdout)["layernorm"]["rows"]


@pytest.mark.slow  # runs the check script for real
def test_a_failing_step_is_reported_and_fails_the_check(tmp_path):
    proc = run_check(tmp_path, with_wheels=True, GPU_CHECK_SECTIONS="kernels", PYTHON="false")
    assert proc.returncode == 1
    assert summary_lines(tmp_path) == {"kernels": "FAIL"}
    assert "kernels" in report(tmp_path, "summary.txt")
