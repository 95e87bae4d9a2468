"""Timing shared by the benchmarks: a synchronized wall-clock sample, interleaved repetitions, and their summary.

Every figure is a median over repetitions in which all contestants run in turn, so that machine noise (other
processes, frequency changes) hits them alike.
"""

import gc
import random
import statistics
import time

import torch


def sync(device) -> None:
    """Wait for the device's queued work, so that a wall-clock sample covers it (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, inner: int = 1) -> float:
    """Seconds per call of fn(), over `inner` calls between two device syncs."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / inner


def interleaved_medians(contestants: dict, repeats: int, device, inner: int = 1, setups: dict | None = None) -> dict:
    """contestants: name -> fn() doing one unit of work. Each repetition times `inner` calls of every
    contestant in a fresh random order (seeded: the same orders every run), so that no contestant always runs
    right after the same other one and inherits its cache and allocator state; returns name -> per-call seconds
    of every repetition. `setups`: name -> fn() run untimed before each of that contestant's samples. The caller
    warms up first."""
    names = list(contestants)
    times = {n: [] for n in names}
    shuffle = random.Random(0).shuffle
    for _ in range(repeats):
        order = list(names)
        shuffle(order)
        for n in order:
            if setups and n in setups:
                setups[n]()
            gc.collect()
            times[n].append(timed(contestants[n], device, inner))
    return times


def summary(samples: list[float]) -> dict:
    """Median, minimum, maximum and count of a contestant's samples."""
    return {"median_s": statistics.median(samples), "min_s": min(samples), "max_s": max(samples),
            "repeats": len(samples)}
