"""scripts/gpu_check.sh, as far as a CPU can run it: its --cpu mode runs the same steps, tiny and on the CPU."""

import json
import os
import subprocess

import pytest

from train_utils import REPO, env


def run_check(out, **extra_env):
    e = {**env(), **extra_env}
    e.pop("PYTHONPATH", None)  # the script sets its own
    return subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu", str(out)], cwd=REPO, env=e,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow  # the script's training runs, launched for real
def test_cpu_mode_runs_the_checks_and_writes_the_numbers(tmp_path):
    out = tmp_path / "report"
    proc = run_check(out, GPU_CHECK_STEPS="kernels steps epoch", GPU_CHECK_VARIANTS="powernorm",
                     NORMLAB_CACHE=str(tmp_path / "cache"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    summary = (out / "summary.txt").read_text().splitlines()
    assert [line.split()[0] for line in summary] == [
        "kernels", "steps-powernorm-single_gpu_bf16", "steps-summary", "default-epoch", "default-epoch-summary"]
    assert all(line.split()[1] == "ok" for line in summary)
    kernels = json.loads((out / "kernels.json").read_text())["checks"]
    assert {c["check"] for c in kernels} == {"custom_layernorm_vs_torch", "fully_padded_row_finite"}
    assert all(c["ok"] for c in kernels)
    (steps,) = json.loads((out / "steps.json").read_text())
    assert steps["status"] == "completed" and steps["steps"] == 2
    assert steps["running_stats_dtypes"] == ["F32"]  # trained under bf16, saved float32
    (epoch,) = json.loads((out / "default_epoch.json").read_text())
    assert epoch["status"] == "completed" and epoch["wall_time_s"] > 0 and epoch["tokens_per_s_median"] > 0
    assert 0 <= epoch["final_eval_accuracy"] <= 1
    assert "torch" in (out / "environment.txt").read_text()


def test_a_failing_step_is_reported_and_fails_the_check(tmp_path):
    out = tmp_path / "report"
    proc = run_check(out, GPU_CHECK_STEPS="kernels", PYTHON="false")
    assert proc.returncode == 1
    # summary.txt may also say that `datasets` is missing (PYTHON=false imports nothing): the kernels line is the one
    (line,) = [x for x in (out / "summary.txt").read_text().splitlines() if x.startswith("kernels")]
    assert line.split()[:2] == ["kernels", "FAIL"]
    assert os.path.exists(out / "logs" / "kernels.log")
