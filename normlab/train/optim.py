"""The optimizer train.py trains with, shared with scripts/bench.py so the benchmark times the same step."""

import torch


def adamw(model, t) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (nanoGPT's rule): biases, norm gains/biases, DyT's alpha and
    every other 1-D parameter are not decayed (decaying a norm's gain towards 0 fights the normalization).
    `t` is the config's `train` section (lr, weight_decay, adam_beta1, adam_beta2).
    fused=True: one kernel over all parameters instead of ~10 ops per parameter (torch >= 2.4 on CPU and CUDA);
    the same update up to float rounding, and a much shorter step (docs/performance.md)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), fused=True)
