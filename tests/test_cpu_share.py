"""A CPU run beside other processes (normlab/train/accelerator.py's thread choice, normlab/train/cpu_share.py): the
threads come from the CPUs this process may use less those others keep busy, OpenMP waits passively, and a starved run
says so once."""

import ast
import subprocess
import sys

import pytest

from normlab.config.loader import REPO_ROOT
from normlab.train import accelerator
from normlab.train.cpu_share import StarvationWatch, prefer_passive_openmp

LAUNCHED = {"ACCELERATE_MIXED_PRECISION": "no", "OMP_NUM_THREADS": "1"}  # what accelerate launch exports


@pytest.fixture
def machine(monkeypatch):
    """8 logical CPUs, 4 physical cores, all allowed; the test changes the affinity it needs."""
    import psutil

    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 8 if logical else 4)
    allow = lambda cpus: monkeypatch.setattr(accelerator.os, "sched_getaffinity",  # noqa: E731 - a one-line local helper
                                             lambda pid: set(range(cpus)), raising=False)
    allow(8)
    return allow


def threads(*args, env=None):
    return accelerator.cpu_threads(*args, env=LAUNCHED if env is None else env)


def test_the_physical_cores_this_process_may_use_split_between_local_processes(machine):
    """Plain `accelerate launch` exports OMP_NUM_THREADS=1 on a machine without GPUs; train.py sets the thread
    count itself, by default as `accelerate launch --cpu` would, and keeps a user's own OMP_NUM_THREADS."""
    assert threads(None, "cpu", 1) == 4  # physical cores, not hyper-threads
    assert threads(None, "cpu", 2) == 2
    assert threads(None, "cpu", 8) == 1  # never 0
    assert threads(None, "cpu", 1, env={}) == 4
    assert threads(3, "cpu", 2) == 3  # an explicit train.cpu_threads wins
    assert threads(None, "cpu", 1, env={"OMP_NUM_THREADS": "1"}) == 1  # python train.py: the user's 1
    assert threads(None, "cpu", 1, env={**LAUNCHED, "OMP_NUM_THREADS": "3"}) == 3
    assert threads(None, "cuda", 1) is None  # GPU runs keep torch's default
    machine(2)
    assert threads(None, "cpu", 1) == 2  # a taskset/container limit counts


def test_the_count_does_not_follow_the_load(machine, monkeypatch):
    """Another process's load does not lower the count (it would change a run's last bits with a load average)."""
    from normlab.train import machine as machine_module

    monkeypatch.setattr(machine_module, "load_average", lambda: [7.0, 7.0, 7.0])
    assert threads(None, "cpu", 1) == 4


def test_openmp_waits_passively_unless_the_user_chose_and_train_py_says_so_before_torch_loads():
    env = {}
    prefer_passive_openmp(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    prefer_passive_openmp(env)
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}
    # the training command: the call comes before any import but its own (OpenMP reads the policy once, when torch
    # loads); train.py and the normlab-train entry point reach it through packages that load nothing else first
    body = ast.parse((REPO_ROOT / "normlab" / "train" / "run.py").read_text()).body
    first_call = next(i for i, node in enumerate(body)
                      if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call))
    assert ast.unparse(body[first_call]) == "prefer_passive_openmp()"
    imports = [node for node in body[:first_call] if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert [ast.unparse(node) for node in imports] == ["from normlab.train.cpu_share import prefer_passive_openmp"]
    shim = [node for node in ast.parse((REPO_ROOT / "train.py").read_text()).body
            if isinstance(node, ast.ImportFrom)]
    assert shim[0].module == "normlab.train.run"
    loads = "import sys, normlab.train, normlab.train.cpu_share; print(sorted(sys.modules))"
    imported = subprocess.run([sys.executable, "-c", loads], cwd=REPO_ROOT, capture_output=True, text=True,
                              check=True).stdout
    assert "'torch'" not in imported  # and what it imports loads no torch


class FakeLoad:
    def __init__(self):
        self.now, self.load = 0.0, [0.5, 0.5, 0.5]

    def clock(self):
        return self.now

    def __call__(self):
        return self.load


def watch(fake, said):
    return StarvationWatch(2, say=said.append, load=fake, cpus=2, clock=fake.clock, settle_s=60)


def test_a_run_whose_rate_falls_far_under_its_start_says_so_once():
    fake, said = FakeLoad(), []
    w = watch(fake, said)
    rates = [500] + [10_000, 9_000] * 10 + [5_000] * 30  # half the rate: a fair share, no warning
    assert not any(w.update(r) for r in rates) and said == []
    assert [w.update(r) for r in [1_000] * 30].count(True) == 1  # a fifth of it: said once, at once
    assert len(said) == 1
    text = said[0]
    assert text.startswith("warning: this run is short of CPU (") and "down from 9,500 at the start" in text
    assert "it runs 2 threads" in text and "Run one training at a time" in text and "train.cpu_threads=N" in text
    assert "OMP_NUM_THREADS" in text


def test_a_load_above_the_cpus_is_said_once_after_the_load_average_has_had_time_to_tell():
    fake, said = FakeLoad(), []
    w = watch(fake, said)
    fake.load = [4.2, 3.0, 1.0]  # two 2-thread runs on 2 CPUs
    assert not w.update(10_000)  # the first minute: the 1-minute average still holds the past
    fake.now = 61.0
    fake.load = [2.4, 2.0, 1.0]  # this run and a little more: no warning
    assert not w.update(10_000)
    fake.load = [4.2, 3.0, 1.0]
    assert w.update(10_000) and not w.update(10_000)
    assert len(said) == 1 and "load average 4.2 on 2 CPUs" in said[0]


def test_no_load_average_no_load_warning():
    fake, said = FakeLoad(), []
    w = watch(fake, said)
    fake.load, fake.now = None, 100.0
    assert not any(w.update(10_000) for _ in range(50)) and said == []
