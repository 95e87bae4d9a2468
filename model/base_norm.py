"""The interface every NormLab norm declares (`Norm`) and the padding mask's row form, shared by the per-token norms
(norms.py) and the batch-statistics family (batch_norms.py), which both build on it.
"""

import torch
import torch.nn as nn


def real_token_mask(x, mask):
    """mask (B, L) of 1/True for real tokens -> bool (B*L,) aligned with x.reshape(-1, D); None = all real."""
    if mask is None:
        return torch.ones(x.shape[:-1].numel(), dtype=torch.bool, device=x.device)
    if mask.shape != x.shape[:-1]:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match x shape {tuple(x.shape)} without its last dim")
    return mask.reshape(-1).to(device=x.device, dtype=torch.bool)


class Norm:
    """What every norm class declares (a mixin next to its torch base class).

    name           its `config.norm` name
    batch_stats    statistics come from the batch: running statistics, a train/eval gap, `bn/*` metrics
    sees_padding   must run on the padded (B, L, D) layout, pad positions included (the naive BatchNorm)
    from_config    how `build_norm` builds it from a NormLabConfig
    initial_values the value every parameter and buffer of its own starts from; the model's `_init_weights`
                   applies them (with transformers' init functions, which skip tensors loaded from a checkpoint)
    """

    name: str
    batch_stats = False
    sees_padding = False

    @classmethod
    def from_config(cls, config, dim: int, **preset) -> nn.Module:
        """`preset`: the registry entry's constructor arguments (`register_norm`); they win over the config's."""
        return cls(dim, **{"eps": config.norm_eps, **preset})

    def initial_values(self) -> dict[str, float]:
        return {"weight": 1.0, "bias": 0.0}
