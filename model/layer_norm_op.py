"""The operator behind CustomLayerNorm: `normlab::layer_norm`, with its backward `normlab::layer_norm_backward`.

The reference below is the readable math, what runs wherever nothing faster is registered (normlab/kernels/
registers C++ on CPU, Triton on CUDA). Every implementation keeps this contract: x (..., M) is normalized over
its last dim in `compute_dtype(x)`; y has x's dtype and shape (contiguous); mean and rstd = 1 / sqrt(var + eps)
have shape x.shape[:-1] and the compute dtype; weight and bias are (M,) or None, any float dtype. The backward
(derived in docs/model.md) returns dx (x's dtype) and dweight, dbias (M,) in the compute dtype.
"""

from typing import Optional

import torch
from torch import Tensor

from .ops import compute_dtype, define_op


def layer_norm_reference(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                         eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """The forward as readable math: x (..., M) -> y (..., M), mean (...), rstd (...)."""
    xf = x.to(compute_dtype(x)).contiguous()  # rows of M contiguous elements, as every kernel produces
    mean = xf.mean(dim=-1)  # (...)
    xc = xf - mean.unsqueeze(-1)
    var = (xc * xc).mean(dim=-1)  # biased: divide by M, as torch.nn.LayerNorm does; two passes, no cancellation
    rstd = torch.rsqrt(var + eps)  # eps inside the square root
    y = xc * rstd.unsqueeze(-1)  # xhat
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y.to(x.dtype), mean, rstd


def layer_norm_backward_reference(dy: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor,
                                  rstd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The hand-derived backward: -> dx (..., M), dweight, dbias (M,)."""
    rstd = rstd.unsqueeze(-1)  # (..., 1)
    xhat = (x.to(mean.dtype) - mean.unsqueeze(-1)) * rstd  # recomputed: cheaper than saving an (..., M) tensor
    dy = dy.to(mean.dtype).contiguous()
    g = dy * weight if weight is not None else dy
    dx = rstd * (g - g.mean(dim=-1, keepdim=True) - xhat * (g * xhat).mean(dim=-1, keepdim=True))
    m = x.shape[-1]
    return dx.to(x.dtype), (dy * xhat).reshape(-1, m).sum(dim=0), dy.reshape(-1, m).sum(dim=0)


def _fake(x, weight, bias, eps):
    stats = x.new_empty(x.shape[:-1], dtype=compute_dtype(x))
    return x.new_empty(x.shape), stats, torch.empty_like(stats)


def _backward_fake(dy, x, weight, mean, rstd):
    return x.new_empty(x.shape), mean.new_empty(x.shape[-1]), mean.new_empty(x.shape[-1])


def _setup_context(ctx, inputs, output):
    x, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.has_bias = bias is not None
    ctx.mark_non_differentiable(mean, rstd)  # statistics for the backward, not outputs to train through


def _backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dweight, dbias = torch.ops.normlab.layer_norm_backward(dy, x, weight, mean, rstd)
    return dx, (dweight if weight is not None else None), (dbias if ctx.has_bias else None), None


layer_norm = define_op("layer_norm", layer_norm_reference, _fake, _setup_context, _backward,
                       layer_norm_backward_reference, _backward_fake)

__all__ = ["layer_norm", "layer_norm_reference", "layer_norm_backward_reference"]
