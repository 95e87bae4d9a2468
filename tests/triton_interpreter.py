"""Runs normlab.kernels' Triton LayerNorm in Triton's interpreter on CPU tensors and prints one JSON line of results;
tests/test_triton_layer_norm.py runs it as `TRITON_INTERPRET=1 python tests/triton_interpreter.py` and judges them.

A separate process because TRITON_INTERPRET must be set before triton is first imported (triton's own
`tl.sum` & co. are jit-decorated at import), and the test process may have imported triton already.

For every case: the maximum absolute error against float64 truth (F.layer_norm on the same values in float64) of
our y, dx, dweight, dbias, and of torch's own LayerNorm run in the case's dtype (the yardstick).
"""

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# name -> (dtype, rows, hidden size, input layout, input generator)
CASES = {}
for _dtype in ("float32", "float16", "bfloat16"):
    for _n in (24, 100, 1000, 3000):
        CASES[f"{_dtype}-{_n}"] = (_dtype, 5, _n, "contiguous", "normal")
    CASES[f"{_dtype}-near_constant"] = (_dtype, 4, 100, "contiguous", "near_constant")
CASES.update({
    "float32-column_slice": ("float32", 6, 100, "column_slice", "normal"),  # rows 128 apart: a strided view
    "bfloat16-transposed": ("bfloat16", 6, 100, "transposed", "normal"),  # no (R, N) view: copied
    "float32-one_row": ("float32", 1, 1000, "contiguous", "normal"),
    "bfloat16-many_rows": ("bfloat16", 37, 300, "contiguous", "normal"),  # bands of 10 rows, the last of 7
    "float32-one_element": ("float32", 4, 1, "contiguous", "normal"),
    "float16-one_element": ("float16", 4, 1, "contiguous", "normal"),
})


def _inputs(torch, dtype, rows, n, layout, kind, gen):
    if kind == "near_constant":  # std 1e-3 around 5: E[x^2] - E[x]^2 would cancel to nothing
        x = 5 + 1e-3 * torch.randn(rows, n, generator=gen)
    else:
        x = 2 * torch.randn(rows, n, generator=gen) + 0.5
    if layout == "column_slice":
        x = torch.cat([x, torch.randn(rows, 128 - n, generator=gen)], dim=1)[:, :n]
    elif layout == "transposed":
        x = x.reshape(rows // 2, 2, n).transpose(0, 1)  # (2, rows/2, n), non-contiguous rows
    x = x.to(dtype)
    w = (1 + 0.5 * torch.randn(n, generator=gen)).to(dtype)  # parameters in the input's dtype, so torch's
    b = (0.5 * torch.randn(n, generator=gen)).to(dtype)  # same-dtype LayerNorm is a fair yardstick
    dy = torch.randn(x.shape, generator=gen).to(dtype)
    return x, w, b, dy


def _layer_norm_with_grads(F, x, w, b, dy, eps):
    x, w, b = (t.detach().clone().requires_grad_(True) for t in (x, w, b))
    y = F.layer_norm(x, x.shape[-1:], w, b, eps)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, b.grad


def run_case(torch, F, tln, name, eps=1e-5):
    dtype, rows, n, layout, kind = CASES[name]
    x, w, b, dy = _inputs(torch, getattr(torch, dtype), rows, n, layout, kind, torch.Generator().manual_seed(0))
    y, mean, rstd = tln.forward(x, w, b, eps)
    ours = (y, *tln.backward(dy, x, w, mean, rstd))
    truth = _layer_norm_with_grads(F, *(t.double() for t in (x, w, b, dy)), eps)
    yardstick = _layer_norm_with_grads(F, x, w, b, dy, eps)

    def err(t, ref):
        return (t.double() - ref).abs().max().item()

    keys = ("y", "dx", "dweight", "dbias")
    return {
        "ours": {k: err(t, ref) for k, t, ref in zip(keys, ours, truth)},
        "torch": {k: err(t, ref) for k, t, ref in zip(keys, yardstick, truth)},
        "scale": {k: ref.abs().max().item() for k, ref in zip(keys, truth)},
        "dtypes": [str(t.dtype).replace("torch.", "") for t in (y, mean, rstd, *ours[1:])],
        "y_contiguous": y.is_contiguous(),
        "exact_zero_dx": bool((ours[1] == 0).all()),
        "y_equals_bias": bool((y == b).all()),
    }


def run_opcheck(torch, tln):
    """torch.library.opcheck with the Triton kernels registered as the operators' CPU implementation (this process
    only): fake implementations, aliasing, autograd and AOT tracing checked against the Triton backend."""
    import model.norms  # noqa: F401 - defines the operators

    lib = torch.library.Library("normlab", "IMPL", "CPU")  # as tln.register() does for CUDA
    lib.impl("layer_norm", tln.forward)
    lib.impl("layer_norm_backward", tln.backward)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 40, generator=gen).to(torch.bfloat16).requires_grad_(True)  # bf16 input, fp32 params
    w, b = torch.randn(40, requires_grad=True), torch.randn(40, requires_grad=True)
    for args in [(x, w, b, 1e-5), (x, None, None, 1e-5), (x.detach().transpose(0, 1), w, None, 1e-5)]:
        torch.library.opcheck(torch.ops.normlab.layer_norm, args)
    y, mean, rstd = torch.ops.normlab.layer_norm(x.detach(), w.detach(), b.detach(), 1e-5)
    dy = torch.randn_like(y)
    torch.library.opcheck(torch.ops.normlab.layer_norm_backward, (dy, x.detach(), w.detach(), mean, rstd))
    return "ok"


def main():
    if os.environ.get("TRITON_INTERPRET") != "1" or "triton" in sys.modules:
        raise SystemExit("run me with TRITON_INTERPRET=1 in a fresh process")
    import torch
    import torch.nn.functional as F

    from normlab.kernels import triton_layer_norm as tln

    torch.set_num_threads(1)
    results = {"cases": {name: run_case(torch, F, tln, name) for name in CASES}}
    try:
        results["opcheck"] = run_opcheck(torch, tln)
    except Exception as err:  # noqa: BLE001 - reported to the test, which fails with the message
        results["opcheck"] = f"{type(err).__name__}: {err}"
    empty = tln.forward(torch.randn(0, 24), None, None, 1e-5)
    results["empty"] = [list(t.shape) for t in (*empty, *tln.backward(torch.randn(0, 24), torch.randn(0, 24), None,
                                                                        empty[1], empty[2]))]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
