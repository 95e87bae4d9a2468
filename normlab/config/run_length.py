"""The step counts a run derives from its length (its optimizer steps, known once the data is loaded): how long it
warms up, and how often it evaluates. Both scale with the run unless set as steps, so a 200-step run neither spends
itself warming up nor evaluates once."""

import math

from model.powernorm import PowerNorm


def warmup_steps(train, total_steps: int) -> int:
    """train.warmup_steps when set (0: none); else the ratio train.warmup_ratio of the run's steps, rounded up, as
    HF's TrainingArguments computes it (`math.ceil(num_training_steps * warmup_ratio)`); 0 when both are null.
    `train`: the config's train section."""
    if train.warmup_steps is not None:
        return train.warmup_steps
    return math.ceil(total_steps * (train.warmup_ratio or 0.0))


def eval_interval(train, total_steps: int) -> int:
    """Optimizer steps between evaluations: train.eval_steps when set; else the run's steps / train.eval_count,
    rounded down to one significant digit (526 -> 500, 104 -> 100, 8 -> 8; at least 1), so that the run evaluates at
    least eval_count times (and at its end) at steps that read well on a chart's axis."""
    if train.eval_steps is not None:
        return train.eval_steps
    every = total_steps // train.eval_count
    if every < 1:
        return 1
    unit = 10 ** (len(str(every)) - 1)
    return every // unit * unit


def norm_warmup_notices(model, batches: int) -> list[str]:
    """PowerNorm normalizes with each batch's statistic during its own warmup and with its running one after: a warmup
    of at least the run's `batches` (training forward passes) means the second never happens, which changes the
    method. One line for each such warmup, to say so before the run."""
    warmups = sorted({m.warmup_steps for m in model.modules() if isinstance(m, PowerNorm)})
    return [f"PowerNorm's warmup, model.powernorm_warmup_steps={w}, covers all {batches} training batches of this run: "
            f"it normalizes with each batch's statistic throughout, never with its running one (set a smaller "
            f"warmup to use both)" for w in warmups if w >= batches]
