"""The declared thresholds of study docs's M and T that the engine's report does not compute (it tests their signs),
from the committed records alone (predictions.md, "Amendment before the first run", item 4):
  M  the manipulation: every random-batch run's mean pad fraction >= 0.55 and every grouped run's <= 0.05
     (board and A/A runs, every LR).
  T  throughput (exploratory): bn_random's median real tokens/s the lowest of the six arms, and bn_random /
     bn_grouped <= 0.6 (the geometric mean over seeds of the per-seed ratio, each arm at its own LR of the rank).
Numpy and the records only, not the engine: an independent recomputation.
    python docs/study-docs/checks.py                 # reads docs/study-docs/records/
    python docs/study-docs/checks.py studies/docs    # or a study directory"""

import gzip
import json
import sys
from pathlib import Path

import numpy as np

RANDOM_AT_LEAST, GROUPED_AT_MOST, RATIO_AT_MOST = 0.55, 0.05, 0.6
ARMS = ("mbn_grouped", "mbn_random", "bn_grouped", "bn_random", "ln_grouped", "ln_random")


def read(folder: Path) -> tuple[list[dict], dict]:
    with gzip.open(folder / "runs.jsonl.gz", "rt") as f:
        runs = [json.loads(line) for line in f]
    selection = json.loads((folder / "selection.json").read_text())
    return [r for r in runs if r["experiment"] in ("board", "aa") and r["status"] == "completed"], selection


def lr_of(selection: dict, arm: str, rank: int) -> float:
    choice = selection[f"tune/{arm}/wuon"]
    return choice["lr"] if rank == 0 else choice["runner_up"]


def by_seed(runs: list[dict], arm: str, lr: float, key: str) -> dict[int, float]:
    return {r["seed"]: r[key] for r in runs
            if r["variant"] == arm and r["experiment"] == "board" and np.isclose(r["lr"], lr)}


def manipulation(runs: list[dict]) -> bool:
    random = [r["pad_fraction"] for r in runs if not r["grouped"]]
    grouped = [r["pad_fraction"] for r in runs if r["grouped"]]
    met = min(random) >= RANDOM_AT_LEAST and max(grouped) <= GROUPED_AT_MOST
    print(f"M: pad fraction, random batches {min(random):.3f}-{max(random):.3f} ({len(random)} runs; declared >= "
          f"{RANDOM_AT_LEAST}), grouped {min(grouped):.3f}-{max(grouped):.3f} ({len(grouped)} runs; declared <= "
          f"{GROUPED_AT_MOST}): {'met' if met else 'NOT met'}")
    return met


def throughput(runs: list[dict], selection: dict) -> None:
    for rank, name in enumerate(("best", "runner-up")):
        if not all(by_seed(runs, a, lr_of(selection, a, rank), "tokens_per_s") for a in ARMS):
            print(f"T, {name} LRs: not every arm has trained there yet")
            continue
        medians = {a: float(np.median(list(by_seed(runs, a, lr_of(selection, a, rank), "tokens_per_s").values())))
                   for a in ARMS}
        slow = by_seed(runs, "bn_random", lr_of(selection, "bn_random", rank), "tokens_per_s")
        fast = by_seed(runs, "bn_grouped", lr_of(selection, "bn_grouped", rank), "tokens_per_s")
        seeds = sorted(set(slow) & set(fast))
        ratio = float(np.exp(np.mean([np.log(slow[s] / fast[s]) for s in seeds])))
        lowest = min(medians, key=medians.get) == "bn_random"
        met = lowest and ratio <= RATIO_AT_MOST
        print(f"T, {name} LRs: median real tokens/s " + ", ".join(f"{a} {m:,.0f}" for a, m in medians.items()))
        print(f"   bn_random the lowest: {'yes' if lowest else 'no'}; bn_random / bn_grouped {ratio:.2f} over "
              f"{len(seeds)} seeds (declared <= {RATIO_AT_MOST}): {'met' if met else 'NOT met'}")


def main(folder: Path) -> None:
    runs, selection = read(folder)
    manipulation(runs)
    throughput(runs, selection)


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent / "records")
