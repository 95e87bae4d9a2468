"""What a training step needs besides the model and accelerate: the model's inputs from a collated batch, and the
check, at the end of an optimizer step, that every process may apply it (train.py's loop; scripts/bench.py times
the same step)."""

import torch

# What the model receives from a collated batch (the collator also returns e.g. `length`; evaluate.py an `index`).
MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "labels")


def model_inputs(batch) -> dict:
    return {k: v for k, v in batch.items() if k in MODEL_INPUTS}


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


__all__ = ["MODEL_INPUTS", "model_inputs", "step_flags"]
