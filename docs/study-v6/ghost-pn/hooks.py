"""Study v6's own outcomes (docs/study-v6/predictions.md), read from each run's record (the engine's RunRecord:
normlab/study/records.py; written by normlab/study/scoring.py):

    drift           the batch-statistic drift (`bn/*/stat_drift`, the mean over the model's batch-statistics
                    modules) averaged over the logged steps after warmup (step > 50)
    acc_running     the last evaluation's accuracy, running statistics (train.py's eval/accuracy)
    acc_batch       the same evaluation with batch statistics (eval/accuracy_batch_stats)
    acc_precise     the same evaluation with precise-BN statistics (eval/accuracy_precise_bn)
    precise_gap     acc_precise - acc_running
    logit_spread    the SD across sentences of the logit difference after 16 steps, from STUDY/signal.jsonl (the
                    study's no-training table: docs/study-v6/pooled_sd.py's rows, one per variant, LR and seed)
"""

import math

from normlab.study.engine import measure

WARMUP = 50


def _last_eval(run, key: str) -> float:
    evals = run.evals(key)  # {step: value} where logged
    return float(evals[max(evals)]) if evals else math.nan


@measure("drift")
def drift(run, study) -> float:
    c = run.curves
    values = [d for s, d in zip(c.get("step", []), c.get("stat_drift", [])) if s > WARMUP and d is not None]
    return sum(values) / len(values) if values else math.nan


measure("acc_running")(lambda run, study: _last_eval(run, "accuracy"))
measure("acc_batch")(lambda run, study: _last_eval(run, "accuracy_batch_stats"))
measure("acc_precise")(lambda run, study: _last_eval(run, "accuracy_precise_bn"))
measure("precise_gap")(lambda run, study: _last_eval(run, "accuracy_precise_bn") - _last_eval(run, "accuracy"))


@measure("logit_spread")
def logit_spread(run, study) -> float:
    rows = [r for r in study.tables.get("signal", [])
            if r["variant"] == run.variant and r["seed"] == run.seed and math.isclose(r["lr"], run.lr)]
    return rows[0]["logit_sd"] if rows else math.nan
