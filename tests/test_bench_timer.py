"""normlab.bench.timer on a fake clock: each contestant's samples are its own per-call time (setups and the other
contestants untimed), every repetition runs every contestant once in a seeded random order, and the summary is
the median, minimum and maximum of the samples."""

import pytest
import torch

from normlab.bench import timer

CPU = torch.device("cpu")


class FakeClock:
    """time.perf_counter that advances only when a contestant or setup says it worked."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def work(self, seconds):
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(timer.time, "perf_counter", c)
    # the timer collects garbage before each sample; in a test process full of earlier tests' objects that is
    # slow, and nothing here is measured in real time
    monkeypatch.setattr(timer.gc, "collect", lambda *args: 0)
    return c


def _race(clock, costs, repeats, inner=1, setup_cost=0.0):
    calls = []

    def contestant(name):
        def fn():
            calls.append(name)
            clock.work(costs[name])
        return fn

    setups = {n: (lambda: clock.work(setup_cost)) for n in costs}
    times = timer.interleaved_medians({n: contestant(n) for n in costs}, repeats, CPU, inner, setups)
    return times, calls


def test_each_sample_is_its_own_per_call_time(clock):
    costs = {"a": 1.0, "b": 3.0, "c": 0.5}
    times, _ = _race(clock, costs, repeats=4, inner=5, setup_cost=100.0)  # setups must stay out of the samples
    assert times == {n: [c] * 4 for n, c in costs.items()}


def test_every_repetition_runs_everyone_once_in_a_seeded_order(clock):
    costs = {n: 1.0 for n in "abcd"}
    _, calls = _race(clock, costs, repeats=12)
    orders = [tuple(calls[i:i + 4]) for i in range(0, len(calls), 4)]
    assert all(sorted(o) == list("abcd") for o in orders)
    assert len(set(orders)) > 1, "the order must change between repetitions"
    assert len({o[0] for o in orders}) > 1, "no contestant may always run first"
    _, again = _race(clock, costs, repeats=12)
    assert again == calls, "seeded: the same orders every run"


def test_timed_divides_by_inner_calls(clock):
    calls = []
    assert timer.timed(lambda: (calls.append(1), clock.work(2.0)), CPU, inner=4) == 2.0
    assert len(calls) == 4


def test_summary():
    assert timer.summary([3.0, 1.0, 2.0, 10.0]) == {"median_s": 2.5, "min_s": 1.0, "max_s": 10.0, "repeats": 4}
