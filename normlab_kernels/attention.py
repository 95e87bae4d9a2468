"""The operator `normlab::attention`, and the Hugging Face attention function that calls it (what
`normlab_kernels.apply` selects, as `attn_implementation`, when the C++ CPU backend is in use).

Why: on CPU, torch's scaled_dot_product_attention has a fused kernel only without dropout. While training, with
dropout on the attention weights, it runs its math path: a dozen separate ops, each with its autograd node, and
torch's CPU dropout, which draws one Mersenne-Twister number per weight, one after the other. This operator is the
same attention with normlab::dropout's hashed mask on the weights, as one forward and one backward operator:

    normlab::attention(q, k, v, bias, seed, p, scale) -> (out, probs)
        probs = softmax(q k^T * scale + bias)             (B, H, L, S), in the compute dtype
        out   = normlab::dropout(probs, seed, p) v         (B, H, L, Dv), in q's dtype
    normlab::attention_backward(grad_out, q, k, v, probs, seed, p, scale) -> (dq, dk, dv)
        d_probs  = normlab::dropout(grad_out v^T, seed, p)  (the same mask and scale: dropout is linear)
        d_scores = probs * (d_probs - rowsum(d_probs * probs))   (softmax's gradient)
        dq = d_scores k * scale,  dk = d_scores^T q * scale,  dv = normlab::dropout(probs, seed, p)^T grad_out

q (B, H, L, D), k (B, H, S, D), v (B, H, S, Dv); bias broadcastable to (B, H, L, S) (the additive padding mask: it
gets no gradient) or None; float64 inputs compute in float64, all others in float32. The mask is a pure function of
(seed, flat index of the weight), so the backward regenerates it and only probs is saved. The same distribution as
SDPA's dropout, not the same masks. A query whose bias is -inf at every key gets NaN, as from torch.softmax (SDPA
gives zeros there); NormLab's padding bias is finite (finfo.min), so its rows never are.

The reference implementation below is those formulas in PyTorch ops (any device); the CPU kernel
(attention_cpu.cpp, registered by normlab_kernels.cpu) runs the matmuls as torch's batched GEMM and fuses the rest.
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
