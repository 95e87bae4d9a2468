"""The operator `normlab::dropout` and the module that calls it, `Dropout` (what `normlab.kernels.use` puts in
place of a model's nn.Dropout with the C++ CPU backend). torch's CPU dropout draws one Mersenne-Twister number per
element, one after the other; this mask is a keyed hash of each element's flat index (docs/kernels.md): parallel,
vectorized, and regenerated from the seed in the backward. The same distribution as nn.Dropout, not the same
masks. The reference below is the hash in PyTorch ops (any device); dropout_cpu.cpp computes the same mask bit
for bit.
"""

import math

import torch
import torch.nn as nn
from torch import Tensor

from model.ops import define_op

MASK32 = 0xFFFFFFFF
MASK64 = 0xFFFFFFFFFFFFFFFF


def _mix32(h: Tensor) -> Tensor:
    """Wellons' lowbias32 on int64 tensors holding 32-bit values (products wrap mod 2**64; the mask keeps 32)."""
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & MASK32
    h = h ^ (h >> 15)
    h = (h * 0x846CA68B) & MASK32
    return h ^ (h >> 16)


def _keys(seed: int) -> tuple[int, int]:
    """splitmix64's finalizer: every bit of the seed reaches both 32-bit keys."""
    z = (seed + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    z ^= z >> 31
    return z & MASK32, z >> 32


def keep_mask(seed: int, numel: int, p: float, device=None) -> Tensor:
    """bool (numel,): which elements of a flattened tensor survive dropout with this seed and p."""
    k0, k1 = _keys(seed & MASK64)
    i = torch.arange(numel, dtype=torch.int64, device=device)
    h = (_mix32(i ^ k0) + k1) & MASK32
    threshold = min(math.floor(p * 2**32 + 0.5), MASK32)
    return _mix32(h) >= threshold


def dropout_reference(x: Tensor, seed: Tensor, p: float) -> Tensor:
    """x * mask(seed) / (1 - p) in PyTorch ops: the operator's implementation where no kernel is registered."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"normlab::dropout: p must be in [0, 1), got {p}")
    if x.numel() > 2**32:
        raise ValueError("normlab::dropout: more than 2**32 elements")
    keep = keep_mask(int(seed), x.numel(), p, x.device).view(x.shape)
    scale = torch.tensor(1.0 / (1.0 - p), dtype=x.dtype, device=x.device)
    return x.contiguous() * torch.where(keep, scale, torch.zeros_like(scale))  # x * (mask * scale), as torch's


def _fake(x, seed, p):
    return x.new_empty(x.shape)  # contiguous, like every implementation's output


def _setup_context(ctx, inputs, output):
    _, seed, p = inputs
    ctx.save_for_backward(seed)
    ctx.p = p


def _backward(ctx, grad):
    # dropout is linear: its backward is the operator itself, the same mask and scale on the gradient (so it has
    # a double backward too, and no backward operator of its own)
    (seed,) = ctx.saved_tensors
    return dropout(grad, seed, ctx.p), None, None


dropout = define_op("dropout", dropout_reference, _fake, _setup_context, _backward)


def draw_seed(device=None) -> Tensor:
    """A 0-dim int64 seed for normlab::dropout from torch's default generator (inside torch.compile, the graph's)."""
    return torch.randint(0, 2**62, (), dtype=torch.int64, device=device)


class Dropout(nn.Dropout):
    """nn.Dropout whose training-mode forward on CPU tensors is normlab::dropout; everywhere else (eval, p of 0 or
    1, inplace, CUDA) it is nn.Dropout's. No parameters or buffers: a model's state dict is the same with either."""

    def forward(self, x: Tensor) -> Tensor:
        if self.training and 0.0 < self.p < 1.0 and not self.inplace and x.device.type == "cpu":
            return dropout(x, draw_seed(), self.p)
        return super().forward(x)
