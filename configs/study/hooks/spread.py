"""The spread of the classifier's inputs after the signal block's Adam steps (normlab/study/signal.py writes
STUDY/signal.jsonl): 1 - the mean pooled cosine between sentences, per arm and seed. Studies v4 (M1) and v5 (the
manipulation check) read it as the outcome `spread`."""

import math

from normlab.study.engine import measure


@measure("spread")
def spread(run, study) -> float:
    rows = [r for r in study.tables.get("signal", []) if r["variant"] == run.variant and r["seed"] == run.seed]
    return 1 - rows[0]["cosine"][-1] if rows else math.nan
