"""The halves of study v6's manipulation checks that the engine's report does not compute, from the committed
records alone (predictions.md declared both):
  part A  the geometric mean over seeds of drift(mbn_g2) / drift(mbn_g32) (and mbn_g8's) at each LR rank, which
          must be at least 2 at both LRs (on top of D-8 and D-2, which the report tests). A run's drift is the
          mean of its logged `stat_drift` (the mean over its batch-statistics modules of |log(group variance /
          running variance)|, RMS over features) over the steps after warmup, as configs/study/hooks/v6.py has it.
  part C  each arm's logit spread at step 16 (signal.jsonl, geometric mean over seeds) at each LR, and whether the
          fixed gain's (center_c) is within a factor 3 of standardization's (std_one); else the gain missed its
          target and the decision rule is not applied.
  part B  where a batch-8 penalty comes from (exploratory): mbn_b8 - ln_pre_b8 against part A's mbn_g8 - ln_pre,
          each arm at its own LR of the rank, paired over seeds within each study; the difference of the two mean
          differences with a percentile bootstrap interval that resamples seeds in each study independently (the
          studies' runs are not paired).
Numpy and the records only, not the engine's hook: an independent recomputation, as docs/study-v5/scorecard.py is.
    python docs/study-v6/checks.py          # reads docs/study-v6/{ghost,batch8}/ and mechanism/signal.jsonl"""

import gzip
import json
import math
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RECORDS, SIGNAL = HERE / "ghost" / "runs.jsonl.gz", HERE / "mechanism" / "signal.jsonl"
GHOST, BATCH8 = HERE / "ghost", HERE / "batch8"
VAL = "val/sorted/running"  # the accuracy the reports state
WARMUP = 50
NEEDED = 2.0  # predictions.md: "at least 2 at both LRs" (4 expected from 1/sqrt(tokens) alone)
LRS = {"best": 0.00178, "runner-up": 0.00316}  # masked BN's quick_v4 choices, shared by its ghost arms


def drift(run: dict) -> float:
    c = run["curves"]
    values = [d for s, d in zip(c["step"], c["stat_drift"]) if s > WARMUP and d is not None]
    return float(np.mean(values))


def per_seed(runs: list[dict], variant: str, lr: float) -> dict[int, float]:
    return {r["seed"]: drift(r) for r in runs
            if r["variant"] == variant and math.isclose(r["lr"], lr) and r["experiment"] == "board"}


def read_runs(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def drift_check(path: Path = RECORDS) -> bool:
    runs = read_runs(path)
    passed = True
    for rank, lr in LRS.items():
        base = per_seed(runs, "mbn_g32", lr)
        means = {g: np.mean(list(per_seed(runs, f"mbn_g{g}", lr).values())) for g in (32, 8, 2)}
        print(f"{rank} LR {lr:g}: mean drift g = 32: {means[32]:.3f}, g = 8: {means[8]:.3f}, g = 2: {means[2]:.3f}")
        for g in (8, 2):
            arm = per_seed(runs, f"mbn_g{g}", lr)
            ratios = np.array([arm[s] / base[s] for s in sorted(arm) if s in base])
            geo = float(np.exp(np.log(ratios).mean()))
            print(f"  drift(g = {g}) / drift(g = 32): geometric mean {geo:.2f} over {len(ratios)} seeds "
                  f"(range {ratios.min():.2f}-{ratios.max():.2f})" + (f"; needed >= {NEEDED:g}" if g == 2 else ""))
            if g == 2 and geo < NEEDED:
                passed = False
    print("manipulation check, ratio part:", "passed" if passed else
          f"FAILED (below {NEEDED:g} at one LR or both): part A decides nothing (predictions.md)")
    return passed


def logit_check(path: Path = SIGNAL) -> bool:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    passed = True
    for lr in sorted({r["lr"] for r in rows}, reverse=True):
        geo = {}
        for arm in dict.fromkeys(r["variant"] for r in rows):
            sd = [r["logit_sd"] for r in rows if r["variant"] == arm and r["lr"] == lr]
            geo[arm] = float(np.exp(np.log(sd).mean()))
            print(f"LR {lr:g}: {arm} logit spread at step 16 {geo[arm]:.3g} (geometric mean over {len(sd)} seeds, "
                  f"range {min(sd):.3g}-{max(sd):.3g})")
        ratio = geo["center_c"] / geo["std_one"]
        print(f"  center_c / std_one = {ratio:.2f}: " + ("within" if 1 / 3 <= ratio <= 3 else "NOT within")
              + " a factor 3")
        passed &= 1 / 3 <= ratio <= 3
    print("manipulation check, the gain's target:", "met" if passed else "missed: the decision rule is not applied")
    return passed


def accuracy_gap(folder: Path, arm: str, ref: str, sweep: dict, rank: int) -> dict[int, float]:
    """{seed: accuracy(arm) - accuracy(ref)} on the board, each at its own LR of the rank (best 0, runner-up 1)."""
    selection = json.loads((folder / "selection.json").read_text())

    def acc(variant, tuned):
        choice = selection[f"tune/{tuned}/wuon"]
        lr = (choice["lr"], choice["runner_up"])[rank]
        return {r["seed"]: r["scores"][VAL]["accuracy"] for r in read_runs(folder / "runs.jsonl.gz")
                if r["variant"] == variant and math.isclose(r["lr"], lr) and "board" in r["experiments"]}

    a, b = acc(arm, sweep[arm]), acc(ref, sweep[ref])
    return {s: a[s] - b[s] for s in sorted(a) if s in b}


def penalty_source(draws: int = 10000) -> None:
    rng = np.random.default_rng(0)
    for rank, name in enumerate(("best", "runner-up")):
        ghost = np.array(list(accuracy_gap(GHOST, "mbn_g8", "ln_pre", {"mbn_g8": "masked_batchnorm",
                                                                         "ln_pre": "ln_pre"}, rank).values()))
        b8 = np.array(list(accuracy_gap(BATCH8, "mbn_b8", "ln_pre_b8", {"mbn_b8": "mbn_b8",
                                                                          "ln_pre_b8": "ln_pre_b8"}, rank).values()))
        boot = (rng.choice(b8, (draws, len(b8))).mean(1) - rng.choice(ghost, (draws, len(ghost))).mean(1))
        lo, hi = np.percentile(boot, [2.5, 97.5])
        print(f"{name} LRs: mbn_b8 - ln_pre_b8 {b8.mean():+.4f} ({len(b8)} seeds); mbn_g8 - ln_pre {ghost.mean():+.4f} "
              f"({len(ghost)} seeds); difference {b8.mean() - ghost.mean():+.4f} [{lo:+.4f}, {hi:+.4f}] "
              f"(95% bootstrap over seeds; exploratory, not tested)")


if __name__ == "__main__":
    drift_check(Path(sys.argv[1]) if len(sys.argv) > 1 else RECORDS)
    logit_check(Path(sys.argv[2]) if len(sys.argv) > 2 else SIGNAL)
    if (BATCH8 / "runs.jsonl.gz").is_file():
        penalty_source()
