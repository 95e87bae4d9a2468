"""normlab/study/worker.py: a warm worker takes a run directory's config file (not a command line); its runs give a
fresh process's numbers, and one run's failure is only that run's."""

import json
import sys

import pytest

from normlab.config.loader import load_config
from normlab.run_dir import RunDir
from normlab.study.executors import Job, subprocess_runner
from normlab.study.worker import WarmRunner
from train_utils import REPO, TINY, env

pytestmark = pytest.mark.slow  # trains in fresh and warm processes

STEPS = ["train.max_steps=6", "train.eval_steps=6", "train.save_steps=6"]


def job(tmp_path, name, *overrides) -> Job:
    """A run as the study hands it over: its config.yaml written into its run directory, and the command that
    starts it in a fresh process."""
    cfg = load_config(None, [f"output_dir={tmp_path / name}", *TINY, *STEPS, *overrides])
    run_dir = RunDir.of(cfg)
    run_dir.save_config(cfg)
    cmd = [sys.executable, str(REPO / "train.py"), "--config", str(run_dir.config_file)]
    return Job(name, cmd, run_dir.path, tmp_path / f"{name}.log", run_dir.config_file)


def losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in rows if "train/loss" in r]


def test_warm_worker_matches_a_fresh_process(tmp_path):
    assert subprocess_runner(job(tmp_path, "fresh", "seed=1"), env()) == 0
    runner = WarmRunner(subprocess_runner)
    try:
        # another run first, so the compared one runs in a worker that has trained before
        assert runner(job(tmp_path, "other", "seed=2", "model.norm=batchnorm"), env()) == 0
        assert runner(job(tmp_path, "warm", "seed=1"), env()) == 0
        assert len(runner.workers) == 1  # both runs in one worker
    finally:
        runner.close()
    assert losses(tmp_path / "warm") == losses(tmp_path / "fresh") and len(losses(tmp_path / "fresh")) == 6
    assert "step 6: eval/loss" in (tmp_path / "warm.log").read_text()  # the run's output went to its own log
    assert runner.workers == []


def test_a_failed_run_is_that_runs_failure_only(tmp_path):
    bad = job(tmp_path, "bad")
    bad.config.write_text(bad.config.read_text().replace("norm: custom_layernorm", "norm: batchnrom"))  # by hand
    runner = WarmRunner(subprocess_runner)
    try:
        assert runner(bad, env()) == 2
        assert "batchnorm" in (tmp_path / "bad.log").read_text()  # the one-line error and its suggestion
        assert runner(job(tmp_path, "good"), env()) == 0
        assert len(runner.workers) == 1
    finally:
        runner.close()


def test_a_job_without_a_config_file_or_with_a_gpu_goes_to_a_fresh_process(tmp_path):
    seen = []
    runner = WarmRunner(lambda j, e: seen.append(j.name) or 7)
    bare = Job("bare", [sys.executable, "-c", "pass"], tmp_path, tmp_path / "x.log")
    gpu = job(tmp_path, "gpu")
    gpu.gpus = 1  # launched under accelerate, which no warm worker can be
    assert runner(bare, env()) == 7 and runner(gpu, env()) == 7 and seen == ["bare", "gpu"]
    assert runner.workers == []
