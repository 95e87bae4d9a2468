"""Who starts a study's runs (docs/studies.md, "Where a study runs"): LocalEngine on this machine (one run per GPU,
or `parallel` CPU runs in warm workers), RayEngine as Ray tasks, retried from their last checkpoint when a worker
dies. An engine runs Jobs and reports each start and end; what a run's end means for the study stays in runner.py.
"""

import os
import queue
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from normlab.errors import StudyError
from normlab.paths import REPO_ROOT
from normlab.run_dir import FINISHED, RunDir
from normlab.study.worker import WarmRunner

DEFAULT_RETRIES = 2
ATTEMPT_MARK = "[study.py] attempt"  # the line a Ray task writes into the run's log before each attempt
# the driver's settings a Ray worker on another node would otherwise not see (a local instance inherits them)
FORWARDED_ENV = ("WANDB_", "HF_", "TRANSFORMERS_", "TOKENIZERS_")
RAY_INSTALL = 'pip install "ray[default]"'


@dataclass
class Job:
    """One run for an engine: its run directory and the config file there that train.py is given (a warm worker
    takes just that); `cmd` starts it in a fresh process (launched under accelerate where it has a GPU)."""

    name: str
    cmd: list[str]
    run_dir: Path
    log: Path
    config: Path | None = None  # the run's config.yaml (None: a bare command, no warm worker can take it)
    gpus: int = 0  # GPUs the run is given (0: none reserved)
    cpus: int = 1  # cores the run uses (a Ray task reserves them)
    env: dict = field(default_factory=dict)  # environment variables on top of the worker's own


@dataclass
class Outcome:
    returncode: int | None  # None: the run never ended by itself (its worker died, the retries ran out)
    duration_s: float | None
    error: str | None = None  # why it could not run, when that is not in its log
    attempts: int = 1
    host: str | None = None


def attempts_logged(log: Path) -> int:
    return log.read_text(errors="replace").count(ATTEMPT_MARK) if log.exists() else 0


def make_engine(name: str, parallel=None, address=None, max_retries=None, warm=True):
    """The engine study.py's command line asks for (StudyError: one line on what is wrong). `warm`: the local
    engine runs train.py in warm workers (normlab/study/worker.py) instead of a fresh process per run."""
    if name == "ray":
        retries = DEFAULT_RETRIES if max_retries is None else max_retries
        if retries < 0:
            raise StudyError(f"--max-retries {retries}: must be 0 or more")
        return RayEngine(address=address, parallel=parallel, max_retries=retries)
    if address is not None or max_retries is not None:
        raise StudyError("--address and --max-retries apply to --engine ray only")
    import torch

    gpus = torch.cuda.device_count()
    if gpus > 1:  # one run per GPU, pinned: each by its own `accelerate launch`, so no warm workers
        return LocalEngine(parallel=min(parallel or gpus, gpus), gpus=gpus)
    runner = WarmRunner(subprocess_runner) if warm else subprocess_runner
    return LocalEngine(parallel=parallel or 1, runner=runner)  # CPU or one GPU: one run at a time unless asked


def run_logged(cmd: list[str], log, env: dict, cwd=REPO_ROOT, own_session: bool = False) -> int:
    """Run cmd, its output into the open file `log`, to its exit code. On Ctrl-C (or a Ray cancel, raised here as
    KeyboardInterrupt) train.py saves a checkpoint and writes summary.json (status interrupted), which the next
    study.py resumes: it gets the time to (own_session, out of a terminal's reach: after one SIGTERM); a second
    interrupt kills it."""
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd, env=env,
                            start_new_session=own_session)
    try:
        while True:
            try:
                return proc.wait(timeout=1)  # short waits: an interrupt is delivered between them
            except subprocess.TimeoutExpired:
                pass
    except KeyboardInterrupt:
        if own_session:
            proc.terminate()
        try:
            proc.wait(timeout=300)
        except (KeyboardInterrupt, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        raise


# ----------------------------------------------------------------------------------------------------------------
# This machine


def subprocess_runner(job: Job, env: dict) -> int:
    """The job's command in a fresh process, to its exit code."""
    with open(job.log, "w") as log:
        return run_logged(job.cmd, log, env)  # the terminal's Ctrl-C reaches train.py too


class LocalEngine:
    """An engine runs Jobs to their end: run_all(jobs, started(job), finished(job, Outcome)); close() when done.
    This one runs on this machine: with `gpus`, one run per GPU at a time; otherwise `parallel` runs at once, the cores
    split between them. `runner(job, env) -> exit code` starts one run (tests pass a fake)."""

    def __init__(self, parallel=1, gpus=0, runner=subprocess_runner):
        self.parallel, self.gpus, self.runner = max(1, parallel), gpus, runner
        self.gpus_per_run = 1 if gpus else 0
        # several CPU runs at once: split the cores instead of letting every run spin on all of them (a user's own
        # OMP_NUM_THREADS wins)
        self.threads_per_run = None
        if not gpus and self.parallel > 1:
            given = os.environ.get("OMP_NUM_THREADS", "")
            self.threads_per_run = int(given) if given.isdigit() else max(1, (os.cpu_count() or 1) // self.parallel)

    def describe(self) -> str:
        where = f"{self.gpus} GPUs, one run each" if self.gpus else f"{self.parallel} run(s) at once"
        return f"local engine: {where}"

    def close(self) -> None:
        if hasattr(self.runner, "close"):
            self.runner.close()

    def run_all(self, jobs: list[Job], started, finished) -> None:
        # GPU ids as this process sees them (a CUDA_VISIBLE_DEVICES set by the user is honoured, not replaced)
        visible = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
        ids = visible[:self.gpus] if len(visible) >= self.gpus else [str(i) for i in range(self.gpus)]
        free_gpus, host = queue.SimpleQueue(), socket.gethostname()
        for gpu in ids:
            free_gpus.put(gpu)

        def one(job):
            env = {**os.environ, **job.env}
            gpu = free_gpus.get() if self.gpus else None
            if gpu is not None:
                env["CUDA_VISIBLE_DEVICES"] = gpu
            started(job)
            start = time.time()
            try:
                returncode, error = self.runner(job, env), None
            except Exception as err:  # a runner that cannot even start (missing python, ...) is a failed run too
                returncode, error = -1, f"{type(err).__name__}: {err}"
            finally:
                if gpu is not None:
                    free_gpus.put(gpu)
            finished(job, Outcome(returncode, round(time.time() - start, 1), error, 1, host))

        if self.parallel <= 1:
            for job in jobs:
                one(job)
            return
        pool, state, stopping = ThreadPoolExecutor(max_workers=self.parallel), threading.Condition(), threading.Event()
        running = []  # the jobs running now

        def guarded(job):  # starts the run unless stopping; under the lock, so a Ctrl-C sees every started run
            with state:
                if stopping.is_set():
                    return
                running.append(job)
            try:
                one(job)
            finally:
                with state:
                    running.remove(job)
                    state.notify_all()

        try:
            futures = [pool.submit(guarded, job) for job in jobs]
            while wait(futures, timeout=0.2).not_done:  # short waits: a Ctrl-C is handled at once, not
                pass  # when a run ends (an untimed wait on a lock need not wake for a signal)
            for future in futures:
                future.result()  # a callback's error
        except KeyboardInterrupt:
            # the running runs got the Ctrl-C too and are saving a checkpoint; the queued ones must not start.
            # Waited for by our own count: a Ctrl-C during submit can leave a started thread out of the pool's.
            with state:
                stopping.set()
                while running:  # short waits again: a second Ctrl-C still ends the driver at once
                    state.wait(timeout=0.2)
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        pool.shutdown()


# ----------------------------------------------------------------------------------------------------------------
# Ray


class RunKilled(RuntimeError):
    """train.py was killed by a signal (out of memory, a preempted node): worth another attempt."""


# Run in front of train.py on Linux: asks the kernel to kill the process when the Ray worker that started it dies
# (PR_SET_PDEATHSIG survives the exec), so a retry never races an orphaned attempt writing into the same run
# directory. A fresh interpreter rather than subprocess's preexec_fn, which may deadlock in a threaded Ray worker.
_DIE_WITH_PARENT = ("import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGKILL); "
                    "os.getppid() == int(sys.argv[1]) or os._exit(1); os.execvp(sys.argv[2], sys.argv[2:])")


def _attempt(cmd: list[str], run_dir: str, log: str, env: dict, cwd: str, driver_python: str) -> dict:
    """One attempt at a run, as a Ray task on some node (which must see the repo and the study directory at the
    same paths as the driver). Appends to the run's log; raises RunKilled when train.py dies by a signal."""
    host, start, log = socket.gethostname(), time.time(), Path(log)
    attempt = 1 + attempts_logged(log)
    if RunDir(run_dir).status() in FINISHED:  # an earlier attempt finished the run before its worker died
        return {"returncode": 0, "duration_s": 0.0, "attempts": attempt, "host": host}
    if cmd[0] == driver_python:  # this node's interpreter, wherever it is installed
        cmd = [sys.executable, *cmd[1:]]
    with open(log, "a") as out:
        out.write(f"{ATTEMPT_MARK} {attempt} on {host}\n")
        out.flush()
        if sys.platform == "linux":
            cmd = [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *cmd]
        returncode = run_logged(cmd, out, {**os.environ, **env}, cwd, own_session=True)  # Ctrl-C reaches it once
    if returncode < 0:
        raise RunKilled(f"train.py was killed by signal {-returncode} (attempt {attempt} on {host})")
    return {"returncode": returncode, "duration_s": round(time.time() - start, 1), "attempts": attempt, "host": host}


class RayEngine:  # the same interface as LocalEngine
    """Every run a Ray task: one GPU each when the cluster has GPUs, else `cpus` cores each (the smallest node's
    cores split `parallel` ways). No address: a new local Ray instance, shut down at the end; "auto" or
    "ray://host:port": an existing cluster. Already connected (ray.init called before): that connection."""

    def __init__(self, address=None, parallel=None, max_retries=DEFAULT_RETRIES, poll_s=1.0):
        try:
            import ray
        except ImportError:
            raise StudyError(f"--engine ray needs Ray, which is not installed: {RAY_INSTALL}") from None
        self.ray, self.max_retries, self.poll_s = ray, max_retries, poll_s
        self.owns_ray = not ray.is_initialized()
        if self.owns_ray:
            try:  # "local": a new instance here, never a cluster some other `ray start` left running
                ray.init(address=address or "local", log_to_driver=False)
            except Exception as err:  # noqa: BLE001 - no cluster at that address, a version mismatch, ...
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise StudyError(f"--address {address}: cannot start or reach Ray ({first})") from None
        resources = ray.cluster_resources()
        node_cpus = [n["Resources"].get("CPU", 0) for n in ray.nodes() if n.get("Alive")]
        node_cpus = [int(c) for c in node_cpus if c >= 1]
        if not node_cpus:
            raise StudyError("the Ray cluster has no node with a CPU to run on")
        self.gpus_per_run = 1 if resources.get("GPU", 0) >= 1 else 0
        self.threads_per_run = None if self.gpus_per_run else max(1, min(node_cpus) // (parallel or 1))
        self.summary = (f"{int(resources.get('CPU', 0))} CPUs, {int(resources.get('GPU', 0))} GPUs "
                        f"on {len(node_cpus)} node(s)")
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import this file
        self._task = ray.remote(_attempt)

    def describe(self) -> str:
        each = "1 GPU" if self.gpus_per_run else f"{self.threads_per_run} CPU(s)"
        return f"ray engine: {self.summary}; {each} per run, up to {self.max_retries} retries"

    def close(self) -> None:
        if self.owns_ray:
            self.ray.shutdown()

    def run_all(self, jobs: list[Job], started, finished) -> None:
        forwarded = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV)}
        refs = {}
        for job in jobs:
            job.log.write_text("")  # this invocation's log of the run; every attempt appends to it
            options = dict(num_gpus=job.gpus, num_cpus=job.cpus, max_retries=self.max_retries,
                           retry_exceptions=[RunKilled], name=job.name)
            refs[self._task.options(**options).remote(job.cmd, str(job.run_dir), str(job.log),
                                                      {**forwarded, **job.env}, str(REPO_ROOT), sys.executable)] = job
        not_started = set(refs)
        try:
            pending = list(refs)
            while pending:
                done, pending = self.ray.wait(pending, num_returns=len(pending), timeout=self.poll_s)
                for ref in [r for r in not_started if r in done or refs[r].log.stat().st_size > 0]:
                    not_started.discard(ref)  # its first attempt wrote its line into the log
                    started(refs[ref])
                for ref in done:
                    finished(refs[ref], self._outcome(ref, refs[ref]))
        except KeyboardInterrupt:
            self._stop(list(refs))
            raise

    def _outcome(self, ref, job: Job) -> Outcome:
        try:
            r = self.ray.get(ref)
            return Outcome(r["returncode"], r["duration_s"], None, r["attempts"], r["host"])
        except self.ray.exceptions.RayError as err:  # the task raised, or its worker/node died too often
            cause = getattr(err, "cause", None)
            first = str(cause if cause is not None else err).strip().splitlines()
            error = f"{type(cause or err).__name__}: {first[0] if first else ''}"
            return Outcome(None, None, error, attempts_logged(job.log), None)

    def _stop(self, refs):
        """Ctrl-C: queued runs never start; running ones save a checkpoint first (study.py resumes them)."""
        print("\nstopping: running runs save a checkpoint (Ctrl-C again to stop them at once)", file=sys.stderr)
        for ref in refs:
            self.ray.cancel(ref)
        try:
            self.ray.wait(refs, num_returns=len(refs), timeout=330)
        except KeyboardInterrupt:
            for ref in refs:
                self.ray.cancel(ref, force=True)
