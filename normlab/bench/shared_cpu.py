"""Two trainings at once on one CPU: the default run (shortened) alone, then two copies started together, each
one's training rate over the lone run's. Goal: each within about its fair share, 2.5x at most. The runs are
separate `python -m normlab.train.run` processes with the thread count train.py chooses itself (docs/performance.md)."""

import os
import subprocess
import sys
import time
from pathlib import Path

from normlab.paths import REPO_ROOT
from normlab.run_dir import RunDir
from normlab.train.machine import available_cpus, cpu_name, load_average
from normlab.train.run_summary import tokens_per_s

GOAL = 2.5  # a concurrent run's time per token over the lone run's, at most


def train_cmd(out: Path, steps: int, overrides) -> list[str]:
    return [sys.executable, "-m", "normlab.train.run", f"output_dir={out}", f"train.max_steps={steps}",
            "wandb.mode=disabled", *overrides]


def settle(quiet_load: float, timeout_s: float) -> list[float] | None:
    """Wait (up to timeout_s) until the 1-minute load average is under quiet_load: the runs after the lone one
    would otherwise see its load and choose fewer threads. -> the load average when done waiting."""
    deadline = time.monotonic() + timeout_s
    while (load := load_average()) is not None and load[0] >= quiet_load and time.monotonic() < deadline:
        time.sleep(5)
    return load and [round(x, 2) for x in load]


def run_together(folders, steps: int, overrides, log_dir: Path) -> dict:
    """Start one training per folder at once; wait for all. -> folder name -> its rate, threads and wall time."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "WANDB_MODE": "disabled"}
    procs = {}
    for out in folders:
        log = open(log_dir / f"{out.name}.log", "w")  # noqa: SIM115 - closed below, after the process ends
        procs[out] = (subprocess.Popen(train_cmd(out, steps, overrides), cwd=REPO_ROOT, env=env, stdout=log,
                                       stderr=subprocess.STDOUT), log, time.monotonic())
    results = {}
    for out, (proc, log, started) in procs.items():
        code = proc.wait()
        log.close()
        if code != 0:
            raise RuntimeError(f"{out.name} exited {code}; its output: {log_dir / f'{out.name}.log'}")
        run = RunDir(out)
        results[out.name] = {"tokens_per_s": tokens_per_s(run.metrics_file),
                             "cpu_threads": run.read_summary()["cpu_threads"],
                             "wall_s": round(time.monotonic() - started, 1)}
    return results


def bench_shared_cpu(work: Path, steps: int, overrides=(), quiet_load: float = 0.5, settle_s: float = 180) -> dict:
    """The lone run, then two together, each phase after the load settles. -> the runs' results and ratios."""
    res = {"cpu": cpu_name(), "cpus": available_cpus(), "steps": steps, "overrides": list(overrides),
           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "PASSIVE (train.py's default)"), "goal": GOAL,
           "load_average_start": settle(quiet_load, settle_s)}
    res["alone"] = run_together([work / "alone"], steps, overrides, work)["alone"]
    res["load_average_between"] = settle(quiet_load, settle_s)
    res["together"] = run_together([work / "first", work / "second"], steps, overrides, work)
    res["load_average_end"] = settle(0, 0)  # now, rounded
    res["slowdown"] = {name: round(res["alone"]["tokens_per_s"] / run["tokens_per_s"], 2)
                       for name, run in res["together"].items()}
    res["meets_goal"] = all(x <= GOAL for x in res["slowdown"].values())
    return res


def print_shared_cpu(res: dict, command: str) -> None:
    print(f"NormLab shared-CPU bench: {res['cpu']}, {res['cpus']} CPUs, {res['steps']} steps of the default run "
          f"{' '.join(res['overrides'])}".rstrip())
    print(f"command: {command}   OMP_WAIT_POLICY: {res['omp_wait_policy']}")
    print(f"load average before / between / after: {res['load_average_start']} / {res['load_average_between']} / "
          f"{res['load_average_end']}  (a busy machine before the lone run makes the ratios meaningless)")
    alone = res["alone"]
    print(f"   {'alone':>6}: {alone['tokens_per_s']:,.0f} tokens/s, {alone['cpu_threads']} threads, "
          f"{alone['wall_s']} s")
    for name, run in res["together"].items():
        print(f"   {name:>6}: {run['tokens_per_s']:,.0f} tokens/s, {run['cpu_threads']} threads, {run['wall_s']} s: "
              f"{res['slowdown'][name]:.2f}x the lone run's time per token")
    print(f"   goal: each at most {GOAL}x -> {'meets goal' if res['meets_goal'] else 'MISSES goal'}")
