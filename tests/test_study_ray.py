"""scripts/study.py --engine ray (normlab/study/executors.py's RayEngine) on a real local Ray instance with 2 CPUs and
real train.py runs of a tiny model on a few hundred SST-2 rows: the study directory it fills has the local engine's
shape and results, a run whose Ray worker is killed mid-run is retried from its last checkpoint and finishes, a finished
study run again starts nothing, and a command killed more often than its retries allow fails with the reason."""

import json
import os
import re
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from normlab.cli import study as study_cli
from normlab.study import executors
from normlab.study import runner as study

pytestmark = pytest.mark.slow  # a study on a local Ray instance

TINY = {"model.hidden_size": 32, "model.num_hidden_layers": 2, "model.num_attention_heads": 2,
        "model.intermediate_size": 64, "model.vocab_size": 1000, "data.max_train_samples": 300,
        "data.max_eval_samples": 96, "train.batch_size": 16, "train.cpu_threads": 1, "wandb.mode": "disabled"}
ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true",
       "TOKENIZERS_PARALLELISM": "false"}


def write_grid(path: Path, name, variants, steps, save_steps) -> Path:
    overrides = {**TINY, "train.max_steps": steps, "train.eval_steps": steps, "train.save_steps": save_steps}
    path.write_text(json.dumps({"name": name, "overrides": overrides, "lr": [2e-3], "warmup": {"on": 2},
                                "seeds": [0], "variants": {v: {"config": v} for v in variants}}))  # JSON is YAML
    return path


@pytest.fixture(scope="module")
def ray_instance():
    """One local Ray instance for the module (its start-up is the slow part); workers inherit ENV."""
    ray = pytest.importorskip("ray", reason=f"the Ray engine needs Ray: {executors.RAY_INSTALL}")
    with pytest.MonkeyPatch.context() as mp:
        for key, value in ENV.items():
            mp.setenv(key, value)
        # processes earlier tests left to this one (e.g. the wandb-core service of an in-process W&B run) are not Ray's
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20,
                 log_to_driver=False)
        children = psutil.Process().children(recursive=True)
        try:
            yield ray
        finally:
            ray.shutdown()
            # everything Ray started for these tests (raylet, workers, their train.py) is gone
            started = [p for p in children + psutil.Process().children(recursive=True) if p.pid not in before]
            _, alive = psutil.wait_procs(started, timeout=20)
            assert not alive, [p.info if hasattr(p, "info") else p for p in alive]


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def test_ray_study_has_the_local_engines_shape_and_results_and_a_rerun_starts_nothing(ray_instance, tmp_path, capsys):
    grid_file = write_grid(tmp_path / "raytiny.yaml", "raytiny", ["pre_ln", "post_ln"], steps=6, save_steps=3)
    grid = study.StudySpec.load(grid_file)
    runs = grid.plan.runs()
    local_dir, ray_dir = tmp_path / "local", tmp_path / "ray"
    assert study.run_study(grid, local_dir, runs, parallel=2, print_fn=lambda *a: None) == {
        r.name: "completed" for r in runs}
    argv = ["--preset", str(grid_file), "--study-dir", str(ray_dir), "--engine", "ray", "--parallel", "2",
            "--no-report"]
    assert study_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "ray engine: 2 CPUs, 0 GPUs on 1 node(s); 1 CPU(s) per run" in out and "done: completed 2" in out

    # the same files, the same study.json entries (the same commands), the same trained runs
    assert tree(ray_dir) == tree(local_dir)
    assert {"runs/pre_ln-lr0.002-wuon-s0/checkpoints/step_6", "logs/post_ln-lr0.002-wuon-s0.log"} <= tree(ray_dir)
    local, ray = (json.loads((d / "study.json").read_text())["runs"] for d in (local_dir, ray_dir))
    for name in local:
        assert set(ray[name]) == set(local[name])
        assert ray[name]["status"] == "completed" and ray[name]["attempts"] == 1 and ray[name]["returncode"] == 0
        assert ray[name]["command"] == local[name]["command"].replace(str(local_dir), str(ray_dir))
        local_final, ray_final = (json.loads((d / "runs" / name / "summary.json").read_text())["final"]
                                  for d in (local_dir, ray_dir))
        assert ray_final["eval/accuracy"] == local_final["eval/accuracy"]
        assert ray_final["eval/loss"] == pytest.approx(local_final["eval/loss"], rel=1e-6)

    # the same command again: nothing is started, nothing written into the runs
    stamps = {p: p.stat().st_mtime_ns for p in ray_dir.rglob("*") if p.is_file() and p.name != "study.json"}
    assert study_cli.main(argv) == 0
    assert "2 runs selected, 2 already finished, 0 to train" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps


def wait_for(predicate, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.02)
    raise AssertionError(f"nothing after {timeout}s")


def last_checkpoint(run_dir: Path) -> int:
    return max((int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*")), default=0)


def train_process(run_dir: Path):
    """The training process (python -m normlab.train.run) writing run_dir, once the run has saved a checkpoint."""
    if not last_checkpoint(run_dir):
        return None
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if cmd[1:3] == ["-m", "normlab.train.run"] and str(run_dir / "config.yaml") in cmd:
            return proc
    return None


def test_a_run_whose_worker_is_killed_is_retried_from_its_last_checkpoint(ray_instance, tmp_path):
    steps = 300  # a few seconds of training: time to kill it between its first checkpoint and its end
    grid_file = write_grid(tmp_path / "raykill.yaml", "raykill", ["pre_ln"], steps=steps, save_steps=20)
    grid = study.StudySpec.load(grid_file)
    runs = grid.plan.runs()
    (name,) = [r.name for r in runs]
    study_dir, run_dir = tmp_path / "study", tmp_path / "study" / "runs" / name
    engine = executors.RayEngine(parallel=2, max_retries=1, poll_s=0.2)
    result = {}
    driver = threading.Thread(target=lambda: result.update(
        study.run_study(grid, study_dir, runs, engine=engine, print_fn=lambda *a: None)))
    driver.start()
    try:
        train = wait_for(lambda: train_process(run_dir), timeout=120)
        worker = train.parent()
        assert worker.pid != os.getpid() and worker.name().startswith("ray::")  # the Ray worker running the task
        worker.kill()
        _, alive = psutil.wait_procs([train], timeout=20)
        assert not alive  # train.py died with its worker: no orphan keeps writing the run directory
        killed_after = last_checkpoint(run_dir)
    finally:
        driver.join(timeout=180)
    assert not driver.is_alive()

    assert result == {name: "completed"}
    record = json.loads((study_dir / "study.json").read_text())["runs"][name]
    assert record["status"] == "completed" and record["attempts"] == 2
    log = (study_dir / "logs" / f"{name}.log").read_text()
    assert log.count(executors.ATTEMPT_MARK) == 2
    resumed = [int(s) for s in re.findall(r"resumed from \S+/checkpoints/step_(\d+)", log)]
    assert resumed == [killed_after] and 20 <= killed_after < steps  # the newest checkpoint when it was killed
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, steps + 1))  # every step once
    assert json.loads((run_dir / "summary.json").read_text())["step"] == steps


def test_a_killed_train_py_is_retried_and_fails_with_the_reason_once_retries_run_out(ray_instance, tmp_path):
    log = tmp_path / "logs" / "dies.log"
    log.parent.mkdir()
    suicide = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    ended = []
    executors.RayEngine(max_retries=1, poll_s=0.2).run_all(
        [executors.Job("dies", suicide, tmp_path / "runs" / "dies", log)], lambda job: None,
        lambda job, outcome: ended.append(outcome))
    (outcome,) = ended
    assert outcome.returncode is None and outcome.attempts == 2  # the first try and one retry
    assert outcome.error.startswith("RunKilled: train.py was killed by signal 9 (attempt 2")
    assert log.read_text().count(executors.ATTEMPT_MARK) == 2


def test_bad_engine_options_are_one_line_errors(tmp_path, capsys, monkeypatch):
    grid_file = write_grid(tmp_path / "g.yaml", "g", ["pre_ln"], steps=2, save_steps=2)
    argv = ["--preset", str(grid_file), "--study-dir", str(tmp_path / "st")]
    assert study_cli.main(argv + ["--max-retries", "3"]) == 2
    assert "--address and --max-retries apply to --engine ray only" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    assert study_cli.main(argv + ["--engine", "ray"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == 'study.py: error: --engine ray needs Ray, which is not installed: pip install "ray[default]"'
    assert not (tmp_path / "st").exists()  # nothing started


def test_local_engine_ctrl_c_lets_running_runs_end_and_starts_no_queued_one(tmp_path, request):
    """With --parallel, Ctrl-C reaches the running train.py processes (they save and stop) and the driver; the
    runs still queued must not start afterwards."""
    import signal

    began, both_running = [], threading.Barrier(2)

    def runner(job, env):
        began.append(job.name)
        both_running.wait(timeout=60)  # a loaded machine may start the second thread late
        if job.name == "a":
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # Ctrl-C while a and b run
        time.sleep(1.0)  # train.py saving its checkpoint
        return 0

    jobs = [executors.Job(n, [n], tmp_path / n, tmp_path / f"{n}.log") for n in "abcd"]
    ended = []
    # a terminal's Ctrl-C: Python's own handler, whatever an earlier test of this process left installed
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    with pytest.raises(KeyboardInterrupt):
        executors.LocalEngine(parallel=2, runner=runner).run_all(jobs, lambda job: None,
                                                               lambda job, outcome: ended.append(job.name))
    assert sorted(began) == ["a", "b"] and sorted(ended) == ["a", "b"]
