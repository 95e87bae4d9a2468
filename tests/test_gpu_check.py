"""scripts/gpu_check.sh rehearsed on the CPU under the GPU machine's conditions (tests/gpu_image_env.py: the image's
package set, python3 only, the returned folder $OUT), and scripts/gpu_prepare.py's plan of what to carry there."""

import json
import subprocess
import tarfile

import pytest

import gpu_image_env
from gpu_image_env import gpu_prepare
from train_utils import REPO, env

CARRIED = {"datasets", "dill", "multiprocess", "omegaconf"}  # what the image lacks of what the check imports


def run_check(tmp_path, with_wheels: bool, **extra_env):
    e = {**gpu_image_env.image_env(env(), tmp_path, with_wheels), **extra_env}
    return subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu"], cwd=REPO, env=e, capture_output=True,
                          text=True, timeout=900)


def summary_lines(tmp_path) -> dict:
    lines = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    return {line.split()[0]: line.split()[1] for line in lines}


def report(tmp_path, name: str):
    """A file of the returned archive (the one file a caller unpacks)."""
    with tarfile.open(tmp_path / "out" / "gpu_check_report.tar.gz") as tar:
        return tar.extractfile(f"report/{name}").read().decode()


def test_prepare_carries_exactly_what_the_image_lacks():
    pins = gpu_prepare.plan()
    assert set(pins) == CARRIED  # not pandas, pyarrow, python-dateutil, xxhash: the image has them
    assert gpu_prepare.plan(gpu_prepare.image_packages() - {"pandas"}).keys() == CARRIED | {"pandas"}
    cmd = gpu_prepare.pip_download_command(pins, REPO / ".whl")
    assert cmd[cmd.index("--python-version") + 1] == "3.12" and "--only-binary=:all:" in cmd
    assert "manylinux2014_x86_64" in cmd and "--no-deps" in cmd
    assert sorted(a.split("==")[0] for a in cmd if "==" in a) == sorted(CARRIED)  # one version each


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
    proc = run_check(tmp_path, with_wheels=True, GPU_CHECK_SECTIONS="triton ln-bench kernels steps epoch")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert summary_lines(tmp_path) == {name: "ok" for name in (
        "triton", "ln-bench", "kernels", "steps-powernorm-single_gpu_bf16", "steps-summary", "default-epoch",
        "default-epoch-summary")}
    # what the device returns: two files; the checkpoints stay in the work folder
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu_check_report.tar.gz", "summary.txt"]
    assert list((tmp_path / "work" / "runs").rglob("model.safetensors"))
    kernels = json.loads(report(tmp_path, "kernels.json"))["checks"]
    assert {c["check"] for c in kernels} == {"fast_backend_registered", "custom_layernorm_vs_float64",
                                             "fully_padded_row_finite"}
    assert all(c["ok"] for c in kernels)
    ln = json.loads(report(tmp_path, "ln_bench.json"))
    assert ln["copy_GBps"] > 0 and {(r["impl"], r["dtype"]) for r in ln["rows"]} == {
        (i, d) for i in ("torch", "normlab") for d in ("float32", "bfloat16")}
    (steps,) = json.loads(report(tmp_path, "steps.json"))
    assert steps["status"] == "completed" and steps["steps"] == 2
    assert steps["running_stats_dtypes"] == ["F32"]  # trained under bf16, saved float32
    (epoch,) = json.loads(report(tmp_path, "default_epoch.json"))
    assert epoch["status"] == "completed" and epoch["wall_time_s"] > 0 and epoch["tokens_per_s_median"] > 0
    assert " passed" in report(tmp_path, "logs/triton.log")


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
