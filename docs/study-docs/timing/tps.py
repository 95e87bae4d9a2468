"""Step-time ratios of time_pairs.sh's runs: `OUT=/tmp/docs_timing/runs python tps.py`.

Per run, the median real tokens/s over steps 2-20 (the first step carries one-time costs); per pair, the arm's step
time over the reference's = (real tokens per batch, arm / reference) x (reference tokens/s / arm tokens/s)."""

import collections
import glob
import json
import os
import statistics

RUNS = os.environ.get("OUT", "/tmp/docs_timing/runs")
TOKENS = {"ref": 469, "docs": 1526}  # real tokens per batch over an epoch (scripts/padding.py)
ARMS = ["ln_random", "ln_grouped", "bn_random", "bn_grouped", "mbn_random", "mbn_grouped"]


def tokens_per_s(run: str) -> float:
    rows = [json.loads(line) for line in open(f"{RUNS}/{run}/metrics.jsonl")]
    return statistics.median(r["train/tokens_per_s"] for r in rows if "train/tokens_per_s" in r and r["step"] >= 2)


ratios, throughput = collections.defaultdict(list), collections.defaultdict(list)
for folder in sorted(glob.glob(f"{RUNS}/*-*-*")):  # the paired runs: RUN-ROUND-ARM
    name = os.path.basename(folder)
    if not name.startswith("ref_sentences") and os.path.exists(f"{folder}/summary.json"):
        arm, rnd, _ = name.split("-")
        arm_tps, ref_tps = tokens_per_s(name), tokens_per_s(f"ref_sentences-{rnd}-{arm}")
        ratios[arm].append(TOKENS["docs"] / arm_tps / (TOKENS["ref"] / ref_tps))
        throughput[arm].append(arm_tps / ref_tps)
for arm in ARMS:
    pairs = " ".join(f"{x:.1f}" for x in ratios[arm])
    print(f"{arm:12} step-time ratio {pairs} median {statistics.median(ratios[arm]):.1f}   "
          f"real tokens/s vs ref: median {statistics.median(throughput[arm]):.2f}")
