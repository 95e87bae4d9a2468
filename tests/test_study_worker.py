"""normlab/study/worker.py: runs in a warm worker give a fresh process's numbers, and one run's failure is only
that run's."""

import json
import sys

import pytest

from normlab.study.engines import subprocess_runner
from normlab.study.worker import WarmRunner, is_train_command
from train_utils import REPO, env, python_cmd

pytestmark = pytest.mark.slow  # trains in fresh and warm processes

STEPS = ["train.max_steps=6", "train.eval_steps=6", "train.save_steps=6"]


def losses(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in rows if "train/loss" in r]


def test_warm_worker_matches_a_fresh_process(tmp_path):
    fresh = tmp_path / "fresh"
    assert subprocess_runner(python_cmd(fresh, "seed=1", *STEPS), tmp_path / "fresh.log", env()) == 0
    runner = WarmRunner(subprocess_runner)
    try:
        # another run first, so the compared one runs in a worker that has trained before
        assert runner(python_cmd(tmp_path / "other", "seed=2", "model.norm=batchnorm", *STEPS),
                      tmp_path / "other.log", env()) == 0
        assert runner(python_cmd(tmp_path / "warm", "seed=1", *STEPS), tmp_path / "warm.log", env()) == 0
        assert len(runner.workers) == 1  # both runs in one worker
    finally:
        runner.close()
    assert losses(tmp_path / "warm") == losses(fresh) and len(losses(fresh)) == 6
    assert "step 6: eval/loss" in (tmp_path / "warm.log").read_text()  # the run's output went to its own log
    assert runner.workers == []


def test_a_failed_run_is_that_runs_failure_only(tmp_path):
    runner = WarmRunner(subprocess_runner)
    try:
        assert runner(python_cmd(tmp_path / "bad", "model.norm=batchnrom", *STEPS), tmp_path / "bad.log", env()) == 2
        assert "batchnorm" in (tmp_path / "bad.log").read_text()  # the one-line error and its suggestion
        assert runner(python_cmd(tmp_path / "good", *STEPS), tmp_path / "good.log", env()) == 0
        assert len(runner.workers) == 1
    finally:
        runner.close()


def test_other_commands_go_to_a_fresh_process(tmp_path):
    seen = []
    runner = WarmRunner(lambda cmd, log, e: seen.append(cmd) or 7)
    cmd = [sys.executable, "-m", "accelerate.commands.launch", str(REPO / "train.py")]
    assert not is_train_command(cmd) and runner(cmd, tmp_path / "x.log", env()) == 7 and seen == [cmd]
    assert runner.workers == []
