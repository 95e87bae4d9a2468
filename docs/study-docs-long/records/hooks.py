"""Study "docs"'s own outcomes (docs/study-docs/predictions.md), read from each run's record (the engine's
RunRecord: normlab/study/records.py; written by normlab/study/scoring.py):

    acc_long        accuracy on the eval documents of 5 and 7 sentences only (running statistics, length-sorted
                    batches: the record's validation score), joined with STUDY/documents.jsonl (each eval
                    document's row and number of sentences, which scoring writes for document data)
    pad_fraction    the run's mean train/pad_fraction over its logged steps (the manipulation check)
    tokens_per_s    the run's median real tokens per second over its logged steps (throughput)
"""

import math

from normlab.study.engine import measure
from normlab.study.records import VAL

LONG = 5  # sentences: a document of at least this many is "long"


@measure("acc_long", at_end="accuracy")  # the final model's accuracy on a subset: the horizon rule guards it
def acc_long(run, study) -> float:
    pred = run.scores.get(VAL, {}).get("pred")
    docs = [d for d in study.tables.get("documents", []) if d["split"] == "val" and d["sentences"] >= LONG]
    if not pred or not docs:
        return math.nan
    return sum(int(pred[d["row"]]) == d["label"] for d in docs) / len(docs)


def _extra(field):
    """The measure of a number scoring keeps beside the curves (NaN in records made before it kept one)."""
    def read(run, study) -> float:
        value = run.extra.get(field)
        return math.nan if value is None else float(value)
    return read


measure("pad_fraction")(_extra("pad_fraction"))
measure("tokens_per_s")(_extra("tokens_per_s"))
