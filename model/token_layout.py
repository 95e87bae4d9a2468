"""Where a batch's real tokens are (`TokenLayout`: the padding mask, the attention bias, the packed layout of the
real tokens only) and the named points of the forward that probes observe (`Tap`, `AttentionLogitsTap`), which
hand that layout to their hooks. The model computes one layout per forward and every module shares it.
"""

import torch
import torch.nn as nn


def padding_to_attention_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, L) bool padding mask -> (B, 1, 1, L) additive bias for attention, in the dtype attention computes in.

    finfo(dtype).min, not -inf: a fully padded row stays finite, and exp() of it is exactly 0 (docs/model.md)."""
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    bias = bias.masked_fill(~mask, torch.finfo(dtype).min)
    return bias[:, None, None, :]  # (B, 1, 1, L): broadcast over heads and queries


class TokenLayout:
    """Where a batch's real tokens are, computed once per forward and shared by every module: mask (B, L) bool or
    None (no padding); `packed` runs only the real tokens, (1, T, D) (ignored without padding)."""

    def __init__(self, mask, packed: bool, dtype: torch.dtype):
        self.mask = mask  # (B, L) bool, or None: no padding
        self.packed = packed and mask is not None
        self.attn_bias = None if mask is None else padding_to_attention_bias(mask, dtype)  # (B, 1, 1, L)
        # Flat indices of the real tokens in the (B*L) grid, (T,). One nonzero() per forward, reused everywhere.
        self.index = mask.reshape(-1).nonzero().squeeze(1) if self.packed else None
        self.norm_mask = None if self.packed else mask  # packed rows are all real tokens
        self.pad = None if mask is None else ~mask.unsqueeze(-1)  # (B, L, 1) True at pad positions

    def clear_pads(self, x):
        """Padded layout: x (B, L, C) with zeros at pad positions. Packed: x, which has no pad rows."""
        if self.packed or self.pad is None:
            return x
        return x.masked_fill(self.pad, 0.0)

    def pack(self, x):
        """(B, L, C) -> (1, T, C) real tokens in the packed layout; identity in the padded one."""
        if not self.packed:
            return x
        return x.reshape(-1, x.shape[-1]).index_select(0, self.index).unsqueeze(0)

    def unpack(self, x):
        """(1, T, C) packed or (B, L, C) padded -> (B, L, C) with zeros at pad positions."""
        if not self.packed:
            return self.clear_pads(x)
        B, L = self.mask.shape
        out = x.new_zeros(B * L, x.shape[-1]).index_copy(0, self.index, x[0])
        return out.view(B, L, x.shape[-1])


class Tap(nn.Module):
    """A named point of the forward that a probe may observe (`NormLabPreTrainedModel.taps`): the identity on x.
    A forward hook registered on it with `with_kwargs=True` gets x as the output and the batch's TokenLayout as
    kwargs["layout"] (packed or padded, where the pads are)."""

    def forward(self, x, *, layout: TokenLayout):
        return x


class AttentionLogitsTap(nn.Module):
    """Where a probe may observe an attention's pre-softmax logits, query @ key^T * `scale`, without the forward
    computing them: the identity on the queries and keys (B, H, L, Dh) they are made of. A forward hook registered
    with `with_kwargs=True` gets kwargs["query"], kwargs["key"] and kwargs["layout"] (TokenLayout)."""

    def __init__(self, scale: float):
        super().__init__()
        self.scale = scale

    def forward(self, *, query, key, layout: TokenLayout):
        return query, key
