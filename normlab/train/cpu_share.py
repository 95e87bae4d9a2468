"""A CPU run beside other processes: OpenMP threads that sleep while they wait instead of spinning on cores
another run needs, and one warning when the run gets far less CPU than it could, with what to do
(docs/training.md, "CPU threads")."""

import os
import statistics
import sys
import time

from normlab.train.machine import available_cpus, load_average


def prefer_passive_openmp(env=os.environ) -> None:
    """OMP_WAIT_POLICY=PASSIVE unless the user chose a policy: by default GNU OpenMP (torch's, and the C++
    kernels') spins a waiting thread for up to 300,000 rounds before it sleeps, which on a shared CPU takes the
    cores from the other run's threads. Only effective before the OpenMP runtime loads (it reads the policy once,
    when torch is imported): train.py does it first thing."""
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")


class StarvationWatch:
    """Fed each logged train/tokens_per_s; says once (through `say`) that the run is short of CPU when its rate
    falls under a third of its first logged rates (median over WINDOW rows each, after the first row's warm-up),
    or, once the 1-minute load average can tell (`settle_s` after the start), when the load exceeds 1.5x the CPUs
    this process may use."""

    WINDOW = 20
    SLOWER = 3.0  # a fair share of 2 runs is about 2x slower; 3x is more than sharing
    OVERLOAD = 1.5

    def __init__(self, threads: int, say=None, load=load_average, cpus=None, clock=time.monotonic,
                 settle_s=60.0):
        self.threads, self.load, self.clock, self.settle_s = threads, load, clock, settle_s
        self.cpus = cpus or available_cpus()
        self.say = say or (lambda text: print(text, file=sys.stderr, flush=True))
        self.rates, self.start, self.warned = [], clock(), False

    def update(self, tokens_per_s: float) -> bool:
        """Take one logged rate; True when this call warned."""
        if self.warned:
            return False
        self.rates.append(tokens_per_s)
        reasons = [r for r in (self._slower(), self._overloaded()) if r]
        if reasons:
            self.warned = True
            self.say(f"warning: this run is short of CPU ({'; '.join(reasons)}; it runs {self.threads} threads): "
                     f"other processes compete for the cores. Run one training at a time, or give each run its "
                     f"share of the {self.cpus} CPUs with train.cpu_threads=N (OMP_NUM_THREADS=N for other "
                     f"programs)")
        return self.warned

    def _slower(self) -> str | None:
        first, recent = self.rates[1:1 + self.WINDOW], self.rates[-self.WINDOW:]
        if len(self.rates) < 1 + 2 * self.WINDOW:  # the first window, then a whole window after it
            return None
        before, now = statistics.median(first), statistics.median(recent)
        if now * self.SLOWER < before:
            return f"{now:,.0f} tokens/s, down from {before:,.0f} at the start"
        return None

    def _overloaded(self) -> str | None:
        load = self.load()
        if load is None or self.clock() - self.start < self.settle_s or load[0] < self.OVERLOAD * self.cpus:
            return None
        return f"load average {load[0]:.1f} on {self.cpus} CPUs"
