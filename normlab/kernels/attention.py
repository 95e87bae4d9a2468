"""The operator `normlab::attention` (its formulas: docs/kernels.md), and the Hugging Face attention function that
calls it (what `normlab.kernels.use` selects, as `attn_implementation`, with the C++ CPU backend). On CPU, torch's
SDPA has a fused kernel only without dropout; in training it runs a dozen ops and torch's sequential dropout. This
is the same attention with normlab::dropout's hashed mask on the weights, as one forward and one backward operator:
the mask is regenerated from the seed, so only probs is saved. The reference below is the formulas in PyTorch ops
(any device); attention_cpu.cpp is the CPU kernel.
"""

import torch
from torch import Tensor
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from model.ops import compute_dtype, define_op

from .dropout import draw_seed, dropout_reference

# The name this attention is registered under in transformers' AttentionInterface (config._attn_implementation).
ATTN_IMPLEMENTATION = "normlab_cpu"


def attention_reference(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, seed: Tensor, p: float,
                        scale: float) -> tuple[Tensor, Tensor]:
    """-> (out (B, H, L, Dv) in q's dtype, probs (B, H, L, S) in the compute dtype)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"normlab::attention: p must be in [0, 1), got {p}")
    ct = compute_dtype(q)
    scores = torch.matmul(q.to(ct), k.to(ct).transpose(-2, -1)) * scale  # (B, H, L, S)
    if bias is not None:
        scores = scores + bias.to(ct)
    probs = scores.softmax(dim=-1)
    out = torch.matmul(dropout_reference(probs, seed, p), v.to(ct))
    return out.to(q.dtype), probs


def attention_backward_reference(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, probs: Tensor, seed: Tensor,
                                 p: float, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    ct = compute_dtype(q)
    grad_out, q, k, v = grad_out.to(ct), q.to(ct), k.to(ct), v.to(ct)
    d_probs = dropout_reference(torch.matmul(grad_out, v.transpose(-2, -1)), seed, p)
    d_scores = probs * (d_probs - (d_probs * probs).sum(dim=-1, keepdim=True))
    dq = torch.matmul(d_scores, k) * scale
    dk = torch.matmul(d_scores.transpose(-2, -1), q) * scale
    dv = torch.matmul(dropout_reference(probs, seed, p).transpose(-2, -1), grad_out)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _fake(q, k, v, bias, seed, p, scale):
    B, H, L, _ = q.shape
    return q.new_empty(B, H, L, v.shape[-1]), q.new_empty(B, H, L, k.shape[-2], dtype=compute_dtype(q))


def _backward_fake(grad_out, q, k, v, probs, seed, p, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, bias, seed, p, scale = inputs
    if bias is not None and bias.requires_grad:
        raise ValueError("normlab::attention: the bias (attention mask) must not require grad")
    ctx.save_for_backward(q, k, v, output[1], seed)
    ctx.p, ctx.scale = p, scale
    ctx.mark_non_differentiable(output[1])  # saved for the backward, not an output to train through


def _backward(ctx, grad_out, _grad_probs):
    q, k, v, probs, seed = ctx.saved_tensors
    dq, dk, dv = torch.ops.normlab.attention_backward(grad_out, q, k, v, probs, seed, ctx.p, ctx.scale)
    return dq, dk, dv, None, None, None, None


attention = define_op("attention", attention_reference, _fake, _setup_context, _backward,
                      attention_backward_reference, _backward_fake)


def normlab_attention_forward(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                              dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """A transformers attention function (AttentionInterface): (B, H, L, D) query/key/value and an additive mask
    -> ((B, L, H, Dv) output, None). normlab::attention where it applies: CPU float32/float64 tensors, a float
    mask, as many key as query heads, a module that is not causal, no extra arguments (a position bias, a softcap).
    Anything else is transformers' own SDPA function, as if this one were not selected: those cases are decided by
    the inputs, never by catching an error."""
    causal = kwargs.pop("is_causal", None)
    causal = getattr(module, "is_causal", True) if causal is None else causal
    if (query.device.type != "cpu" or query.dtype not in (torch.float32, torch.float64) or causal
            or key.shape[1] != query.shape[1] or any(v is not None for v in kwargs.values())
            or (attention_mask is not None and not attention_mask.is_floating_point())):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=causal, **kwargs)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    seed = draw_seed() if dropout > 0 else torch.zeros((), dtype=torch.int64)  # draws only where a mask is used
    out, _ = attention(query, key, value, attention_mask, seed, float(dropout), float(scale))
    return out.transpose(1, 2).contiguous(), None


def register_attention_function() -> None:
    """Make ATTN_IMPLEMENTATION a valid attn_implementation for transformers models (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, normlab_attention_forward)
