"""One training step as train.py's loop takes it (scripts/bench.py times the same): the model's inputs from a
collated batch, forward, backward, clipping, the all-process non-finite and stop check, the optimizer step; and the
clock of its mean time (summary.json's step_time_s)."""

import time
from contextlib import nullcontext
from typing import NamedTuple

import torch

# What the model receives from a collated batch (the collator also returns e.g. `length`; evaluate.py an `index`).
MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "labels")


def model_inputs(batch) -> dict:
    return {k: v for k, v in batch.items() if k in MODEL_INPUTS}


class StepResult(NamedTuple):
    loss: torch.Tensor
    grad_norm: float  # before clipping
    nonfinite: bool  # a non-finite loss or gradient on some process: the update was not applied
    interrupted: bool  # a stop signal on some process


def train_step(accelerator, model, optimizer, batch, max_grad_norm: float, probe=None, log: bool = False,
               stop=None) -> StepResult | None:
    """One micro-batch: forward and backward, and at the window's last micro-batch (accelerate's accumulate) the
    clipping, the checks and the optimizer step. -> None while the window has more micro-batches. `probe`: a
    StabilityProbe that counts every micro-batch, and with `log` measures the optimizer step's last one; `stop`:
    an object whose `requested` says a stop signal arrived."""
    with accelerator.accumulate(model):  # decides sync_gradients: is this the window's last micro-batch?
        measure = log and accelerator.sync_gradients
        with probe.forward(batch["attention_mask"]) if measure else nullcontext():
            loss = model(**model_inputs(batch)).loss
        accelerator.backward(loss)
        if probe is not None:
            probe.count(loss, batch["attention_mask"])
        if not accelerator.sync_gradients:
            return None
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)  # the pre-clip norm
        nonfinite, interrupted = step_flags(accelerator, loss, grad_norm, stop is not None and stop.requested)
        grad_norm = grad_norm.item()
        if not nonfinite:
            with probe.update(grad_norm, max_grad_norm) if measure else nullcontext():
                optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return StepResult(loss, grad_norm, nonfinite, interrupted)


def step_flags(accelerator, loss, grad_norm, stop_requested: bool) -> tuple[bool, bool]:
    """(non-finite loss or gradient, stop signal) on any process: one tiny all-reduce per optimizer step keeps
    every process stopping at the same step. Under fp16 the grad scaler owns inf gradients (it skips the step
    and lowers the scale), so there only the loss counts."""
    bad = ~torch.isfinite(loss.detach().float())
    if accelerator.mixed_precision != "fp16":
        bad = bad | ~torch.isfinite(grad_norm.to(bad.device))
    flags = torch.stack([bad.float(), torch.tensor(float(stop_requested), device=bad.device)])
    if accelerator.num_processes > 1:
        flags = accelerator.reduce(flags, "sum")
    nonfinite, interrupted = (flags > 0).tolist()
    return nonfinite, interrupted




class StepClock:
    """summary.json's step_time_s: the mean time from an optimizer step's first micro-batch to its metrics row."""

    def __init__(self):
        self.total_s, self.steps, self.started = 0.0, 0, None

    def micro_batch(self) -> None:
        self.started = self.started or time.perf_counter()

    def step_done(self) -> None:
        self.total_s += time.perf_counter() - self.started
        self.steps, self.started = self.steps + 1, None

    def mean_s(self) -> float:
        return round(self.total_s / max(self.steps, 1), 5)


__all__ = ["MODEL_INPUTS", "model_inputs", "StepResult", "train_step", "step_flags", "StepClock"]
