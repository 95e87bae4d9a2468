"""A hand-written Triton LayerNorm: the CUDA implementation of normlab::layer_norm and normlab::layer_norm_backward,
with the contract of the reference in model/layer_norm_op.py (computed in float32, float64 for float64; mean and
rstd saved per row). The layout (one program per row forward, fixed bands of rows backward: bitwise reproducible
gradients) is described in docs/kernels.md. Tested on CPU under TRITON_INTERPRET=1 and compiled for sm_90 without a
GPU (tests/test_triton_layer_norm.py).
"""

import math
from contextlib import nullcontext

import torch
import triton
import triton.language as tl

from model.ops import compute_dtype

MAX_ROW_BYTES = 65536  # a row must fit one block of registers (the usual limit of single-pass layer norms)
MIN_BAND = 8  # the backward's fewest rows per program (see _backward_programs)
# No multiply-add contraction: every product and sum rounded on its own, as in the reference ops and the C++
# kernel (-ffp-contract=off). Passed explicitly: Triton's default for it is changing between versions.
FP_FUSION = False


@triton.jit
def _forward_kernel(X, Y, W, B, Mean, Rstd, x_row_stride, N, eps,
                    HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # 64-bit offsets: row * stride may pass 2**31 elements
    cols = tl.arange(0, BLOCK_N)
    inside = cols < N
    acc = Mean.dtype.element_ty  # the compute dtype: float32, or float64 for float64 inputs
    x = tl.load(X + row * x_row_stride + cols, mask=inside, other=0.0).to(acc)
    mean = tl.sum(x, axis=0) / N
    xc = tl.where(inside, x - mean, 0.0)  # padding columns must not enter the variance
    var = tl.sum(xc * xc, axis=0) / N  # biased, as torch.nn.LayerNorm
    rstd = 1.0 / tl.sqrt_rn(var + eps)  # eps inside the square root
    y = xc * rstd
    if HAS_W:
        y = y * tl.load(W + cols, mask=inside, other=0.0).to(acc)
    if HAS_B:
        y = y + tl.load(B + cols, mask=inside, other=0.0).to(acc)
    tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=inside)  # Y is contiguous
    tl.store(Mean + row, mean)
    tl.store(Rstd + row, rstd)


@triton.jit
def _backward_kernel(DY, X, W, Mean, Rstd, DX, DW_part, DB_part, dy_row_stride, x_row_stride, n_rows, N,
                     rows_per_program, HAS_W: tl.constexpr, BLOCK_N: tl.constexpr):
    band = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    inside = cols < N
    acc = Mean.dtype.element_ty
    if HAS_W:
        w = tl.load(W + cols, mask=inside, other=0.0).to(acc)
    dw = tl.zeros((BLOCK_N,), dtype=acc)
    db = tl.zeros((BLOCK_N,), dtype=acc)
    first = band * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    # the next row is loaded before this one is reduced: its memory traffic overlaps this row's arithmetic
    # (a program's rows are otherwise strictly serial: load, reduce, store). Past the band's end the index is
    # clamped to a row that exists: one unused row load per program, and no per-row branch.
    nxt = tl.minimum(first, n_rows - 1)
    x_next = tl.load(X + nxt * x_row_stride + cols, mask=inside, other=0.0)
    dy_next = tl.load(DY + nxt * dy_row_stride + cols, mask=inside, other=0.0)
    for row in range(first, last):
        x = x_next.to(acc)
        dy = dy_next.to(acc)
        nxt = tl.minimum(row + 1, last - 1)
        x_next = tl.load(X + nxt * x_row_stride + cols, mask=inside, other=0.0)
        dy_next = tl.load(DY + nxt * dy_row_stride + cols, mask=inside, other=0.0)
        rstd = tl.load(Rstd + row)
        xhat = tl.where(inside, (x - tl.load(Mean + row)) * rstd, 0.0)
        if HAS_W:
            g = dy * w
        else:
            g = dy
        # dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), the reference's formula
        dx = rstd * (g - tl.sum(g, axis=0) / N - xhat * (tl.sum(g * xhat, axis=0) / N))
        tl.store(DX + row * N + cols, dx.to(DX.dtype.element_ty), mask=inside)  # DX is contiguous
        dw += dy * xhat
        db += dy
    tl.store(DW_part + band * N + cols, dw, mask=inside)
    tl.store(DB_part + band * N + cols, db, mask=inside)


def _rows(t):
    """(..., N) -> an (R, N) view with unit stride along N (a copy only when no such view exists)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _block(x):
    """The power-of-two block holding one row, and the warps to spread it over (the tutorial's heuristic)."""
    n = x.shape[-1]
    block = triton.next_power_of_2(n)
    if block * x.element_size() > MAX_ROW_BYTES:
        raise ValueError(f"Triton LayerNorm: rows of {n} {x.dtype} elements do not fit one block (at most "
                         f"{MAX_ROW_BYTES} bytes); run the reference implementation (train.kernels=reference)")
    return block, min(max(block // 256, 1), 8)


def _backward_warps(block: int, forward_warps: int) -> int:
    """16 from 8192 columns on: the backward holds ~ten row-sized arrays per program, and 8 warps would leave each
    thread over 300 values (spilled to local memory)."""
    return 16 if block >= 8192 else forward_warps


def _backward_programs(device, n_rows, block: int, warps: int):
    """How many row bands the backward splits into: as many programs as fit on the GPU at once, from the SM count,
    warps (64 per SM) and registers (64K per SM; ~ten row arrays per thread plus ~40); at least MIN_BAND rows
    each, so the partial rows stay a fraction of dx. (4 on CPU: the interpreter runs them one by one.)"""
    if device.type != "cuda":
        return max(1, min(n_rows, 4))
    threads = 32 * warps
    regs = min(255, 10 * max(1, block // threads) + 40)
    per_sm = max(1, min(64 // warps, 65536 // (regs * threads)))
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(math.ceil(n_rows / MIN_BAND), per_sm * sms))


def forward(x, weight, bias, eps):
    """normlab::layer_norm: -> y (x's shape and dtype, contiguous), mean, rstd (x.shape[:-1], compute dtype)."""
    rows = _rows(x)
    n_rows, n = rows.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    mean = torch.empty(x.shape[:-1], dtype=compute_dtype(x), device=x.device)
    rstd = torch.empty_like(mean)
    if n_rows == 0:
        return y, mean, rstd
    block, warps = _block(x)
    w = weight.contiguous() if weight is not None else rows  # (a pointer the kernel never reads)
    b = bias.contiguous() if bias is not None else rows
    with torch.cuda.device(x.device) if x.is_cuda else nullcontext():
        _forward_kernel[(n_rows,)](rows, y, w, b, mean, rstd, rows.stride(0), n, eps,
                                   HAS_W=weight is not None, HAS_B=bias is not None, BLOCK_N=block, num_warps=warps,
                                   enable_fp_fusion=FP_FUSION)
    return y, mean, rstd


def backward(dy, x, weight, mean, rstd):
    """normlab::layer_norm_backward: -> dx (x's shape and dtype, contiguous), dweight, dbias (N,)."""
    rows, dy_rows = _rows(x), _rows(dy)
    n_rows, n = rows.shape
    acc = mean.dtype
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n_rows == 0:
        return dx, torch.zeros(n, dtype=acc, device=x.device), torch.zeros(n, dtype=acc, device=x.device)
    block, warps = _block(x)
    warps = _backward_warps(block, warps)
    programs = _backward_programs(x.device, n_rows, block, warps)
    dw_part = torch.empty(programs, n, dtype=acc, device=x.device)
    db_part = torch.empty(programs, n, dtype=acc, device=x.device)
    w = weight.contiguous() if weight is not None else rows
    with torch.cuda.device(x.device) if x.is_cuda else nullcontext():
        _backward_kernel[(programs,)](dy_rows, rows, w, mean.contiguous(), rstd.contiguous(), dx, dw_part, db_part,
                                      dy_rows.stride(0), rows.stride(0), n_rows, n, math.ceil(n_rows / programs),
                                      HAS_W=weight is not None, BLOCK_N=block, num_warps=warps,
                                      enable_fp_fusion=FP_FUSION)
    return dx, dw_part.sum(dim=0), db_part.sum(dim=0)


_registration = None  # the torch.library.Library holding the CUDA registrations while they are on


def register():
    """These kernels become the CUDA implementation of normlab::layer_norm and normlab::layer_norm_backward. They
    run once first on a tiny input, so a GPU or toolchain Triton cannot compile for fails here, before training."""
    global _registration
    if _registration is None:
        x = torch.linspace(-1.0, 1.0, 16, device="cuda").reshape(2, 8)  # (no random numbers drawn)
        backward(x, x, None, *forward(x, None, None, 1e-5)[1:])
        torch.cuda.synchronize()
        lib = torch.library.Library("normlab", "IMPL", "CUDA")
        lib.impl("layer_norm", forward)
        lib.impl("layer_norm_backward", backward)
        _registration = lib


def unregister():
    """Back to the operators' reference implementation on CUDA: a Library's registrations end with the object."""
    global _registration
    _registration = None
