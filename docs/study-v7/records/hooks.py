"""Study v7's own outcomes (docs/study-v7/predictions.md), read from each run's record (normlab/study/records.py's
RunRecord, written by normlab/study/scoring.py):

    stat_noise          the lag-free noise of the batch statistics: at each evaluation, precise BN's training-mode
                        forwards over 50 training batches give each block norm's batch (or ghost-group) statistics
                        and the population statistics of the same weights; the distance between them
                        (model/batch_norms.py `stat_distance`), averaged over the norms of each block and the
                        blocks (the record's `stat_noise`), then over the run's evaluations. NaN for a run without
                        batch statistics.
    partner_dependence  at the end, the RMS over validation sentences of the SD of its logit margin over 8 random
                        batchings (the run's training batch, grouped as in training), over the SD across sentences
                        (the record's `partner_dependence`; `score: partner_batchings`)
"""

import math

from normlab.study.engine import measure


@measure("stat_noise")
def stat_noise(run, study) -> float:
    values = list(run.evals("stat_noise").values())
    return sum(values) / len(values) if values else math.nan


measure("partner_dependence")(lambda run, study: run.extra.get("partner_dependence") or math.nan)
