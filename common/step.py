"""One training step, as train.py runs it and scripts/bench.py times it.

A step here is one micro-batch: forward and backward; on the last micro-batch of an optimizer step (accelerate's
`sync_gradients`) also clipping, the non-finite check, the optimizer and schedule steps. Gradient accumulation,
mixed precision and the distributed wrappers are accelerate's (`accumulate`, `backward`, `clip_grad_norm_`).
"""

from contextlib import nullcontext
from dataclasses import dataclass

import torch

# What the model receives from a collated batch (the collator also returns e.g. `length`; evaluate.py an `index`).
MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "labels")


def model_inputs(batch) -> dict:
    return {k: v for k, v in batch.items() if k in MODEL_INPUTS}


@dataclass
class StepResult:
    loss: torch.Tensor  # this micro-batch's loss (on the device: no host sync)
    synced: bool  # an optimizer step ended with this micro-batch; the fields below are set only then
    grad_norm: float | None = None  # total gradient norm before clipping
    lr: float | None = None  # the learning rate this step used
    nonfinite: bool = False  # non-finite loss or gradient on some process: the update was not applied
    interrupted: bool = False  # a stop signal arrived on some process


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


def train_step(accelerator, model, optimizer, scheduler, batch, max_grad_norm: float, probe=None,
               stop_requested: bool = False) -> StepResult:
    """Forward, backward, and at the end of an optimizer step: clip, check, step. `probe` (a StabilityProbe, on
    logging steps) measures the optimizer step's last micro-batch and its update."""
    with accelerator.accumulate(model):  # decides sync_gradients: is this the window's last micro-batch?
        measure = probe is not None and accelerator.sync_gradients
        with probe.forward(batch["attention_mask"]) if measure else nullcontext():
            loss = model(**model_inputs(batch)).loss
        accelerator.backward(loss)
        if not accelerator.sync_gradients:
            return StepResult(loss, synced=False)
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)  # returns the pre-clip norm
        nonfinite, interrupted = step_flags(accelerator, loss, grad_norm, stop_requested)
        grad_norm, lr = grad_norm.item(), optimizer.param_groups[0]["lr"]
        if not nonfinite:
            with probe.update(grad_norm, max_grad_norm) if measure else nullcontext():
                optimizer.step()
                scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return StepResult(loss, True, grad_norm, lr, nonfinite, interrupted)


__all__ = ["MODEL_INPUTS", "model_inputs", "StepResult", "step_flags", "train_step"]
