"""Warm workers: many training runs in one long-lived Python process each (docs/studies.md), paying Python's start
and the imports once. A job is a run directory's config file (normlab.train.run's --config), not a command line.
Each run's output goes to its own log and its numbers are those of a fresh process (tests/test_study_worker.py).

    python -m normlab.study.worker      # reads one JSON job per line on stdin, answers one JSON line per job
"""

import contextlib
import json
import os
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from unittest import mock

from normlab.paths import REPO_ROOT


@contextlib.contextmanager
def output_to(log_path: str):
    """Send fds 1 and 2 (Python's and C's output) to log_path for the duration."""
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log_path, "a") as log:
        os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])


def run_job(job: dict) -> int:
    from accelerate.state import AcceleratorState, GradientState

    from normlab.train import run  # imported once per worker: this is the saving; first: it sets OpenMP's wait policy

    # accelerate keeps its state in process-wide singletons; a run starts from none, as in a fresh process
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    # the run's own variables (OMP_NUM_THREADS ...) for its duration; the worker's environment is restored after it
    with output_to(job["log"]), mock.patch.dict(os.environ, job.get("env", {})):
        try:
            return run.main(["--config", job["config"]])
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else 1
        except Exception:  # a crash of one run is that run's failure (exit 1, as a fresh process), not the worker's
            traceback.print_exc()
            return 1


def serve() -> int:
    replies = os.fdopen(os.dup(1), "w", buffering=1)  # our own channel: fd 1 is lent to each run's log
    os.chdir(REPO_ROOT)  # train.py's relative paths (configs/) are the repo's; `-m` from there put it on the path
    for line in sys.stdin:
        replies.write(json.dumps({"returncode": run_job(json.loads(line))}) + "\n")
    return 0


class WarmRunner:
    """A runner for study.executors' LocalEngine, `runner(job, env) -> exit code`: a job with a config file and no
    GPU goes to a warm worker of the calling thread (one worker per parallel slot), anything else (a launcher such
    as accelerate's) to `fallback`, a fresh process. A worker that dies (killed, out of memory) fails its run like a
    fresh process would, and the next run gets a new one."""

    def __init__(self, fallback):
        self.fallback, self.local, self.workers, self.lock = fallback, threading.local(), [], threading.Lock()

    def _worker(self, env: dict) -> subprocess.Popen:
        proc = getattr(self.local, "proc", None)
        if proc is None or proc.poll() is not None:
            proc = subprocess.Popen([sys.executable, "-m", "normlab.study.worker"], cwd=REPO_ROOT, env=env, text=True,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
            self.local.proc = proc
            with self.lock:
                self.workers.append(proc)
        return proc

    def __call__(self, job, env: dict) -> int:
        if job.config is None or job.gpus:
            return self.fallback(job, env)
        Path(job.log).write_text("")  # a fresh log, as a fresh process's runner writes
        extra = {k: v for k, v in env.items() if os.environ.get(k) != v}
        proc = self._worker(env)
        try:
            proc.stdin.write(json.dumps({"config": str(job.config), "log": str(job.log), "env": extra}) + "\n")
            proc.stdin.flush()
            reply = proc.stdout.readline()
        except BrokenPipeError:
            reply = ""
        if not reply:  # the worker died mid-run
            proc.wait()
            return proc.returncode if proc.returncode else -9
        return json.loads(reply)["returncode"]

    def close(self) -> None:
        with self.lock:
            for proc in self.workers:
                if proc.poll() is None:
                    proc.stdin.close()
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
            self.workers.clear()


if __name__ == "__main__":
    sys.exit(serve())
