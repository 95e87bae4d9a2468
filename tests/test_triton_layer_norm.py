"""normlab.kernels' Triton LayerNorm (the CUDA backend of normlab::layer_norm) tested without a GPU:

1. run by Triton's interpreter on CPU tensors (tests/triton_interpreter.py, in its own process) and judged against
   float64 truth the way flash-attention's kernel tests judge theirs: our maximum error at most twice that of
   torch's own LayerNorm in the same dtype, plus one unit in the last place of the dtype at the result's scale
   (the interpreter truncates float32 -> bfloat16 where a GPU rounds to nearest, so its bfloat16 results may be a
   full unit off where torch's are half a unit); forward and backward, float32/float16/bfloat16, odd hidden
   sizes, strided and transposed inputs, near-constant rows, one row, one element; and opcheck with the Triton
   kernels as the operators' implementation;
2. compiled for Hopper (sm_90) down to a cubin, without running, so a kernel that would not build for the real
   target fails here.
On a GPU, scripts/gpu/gpu_check.sh runs this file with `-k "not interpreted"`: the compiled kernels only (the tests of
1. keep "interpreted" in their names; tests/test_gpu_check.py checks that selection).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.triton_interpreter import CASES

pytestmark = pytest.mark.slow  # Triton's interpreter and an sm_90 compile

triton = pytest.importorskip("triton", reason="triton is not installed: the CUDA LayerNorm backend cannot be tested")

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def interpreted():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "triton_interpreter.py")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", list(CASES))
def test_interpreted_kernels_match_float64_truth(interpreted, case):
    dtype = CASES[case][0]
    r = interpreted["cases"][case]
    ulp = torch.finfo(getattr(torch, dtype)).eps
    for quantity in ("y", "dx", "dweight", "dbias"):
        bound = 2 * r["torch"][quantity] + ulp * r["scale"][quantity]
        assert r["ours"][quantity] <= bound, (quantity, r)
    compute = "float32"  # half precision is normalized in float32; mean, rstd and dweight/dbias stay float32
    assert r["dtypes"] == [dtype, compute, compute, dtype, compute, compute]
    assert r["y_contiguous"]
    if CASES[case][2] == 1:  # one element per row: y is exactly the bias, and no gradient reaches x
        assert r["y_equals_bias"] and r["exact_zero_dx"]


def test_interpreted_opcheck_and_empty_input(interpreted):
    assert interpreted["opcheck"] == "ok"
    assert interpreted["empty"] == [[0, 24], [0], [0], [0, 24], [24], [24]]  # y, mean, rstd, dx, dweight, dbias


HOPPER = ("cuda", 90, 32)  # triton.backends.compiler.GPUTarget: backend, compute capability, warp size


@pytest.mark.parametrize("hidden,x_type", [(128, "fp32"), (1000, "bf16"), (4096, "bf16"), (8192, "bf16")])
def test_kernels_compile_for_hopper(hidden, x_type):
    from triton.backends.compiler import GPUTarget

    from normlab.kernels import triton_layer_norm as tln

    if not isinstance(tln._forward_kernel, triton.runtime.jit.JITFunction):
        pytest.skip("TRITON_INTERPRET is set in this process: the kernels are interpreted, not compiled")
    block, warps = tln._block(torch.empty(1, hidden, dtype=torch.float32 if x_type == "fp32" else torch.bfloat16))
    x, f32 = f"*{x_type}", "*fp32"  # training's dtypes: activations x_type, parameters and statistics fp32
    forward = {"X": x, "Y": x, "W": f32, "B": f32, "Mean": f32, "Rstd": f32, "x_row_stride": "i32", "N": "i32",
               "eps": "fp32", "HAS_W": "constexpr", "HAS_B": "constexpr", "BLOCK_N": "constexpr"}
    backward = {"DY": x, "X": x, "W": f32, "Mean": f32, "Rstd": f32, "DX": x, "DW_part": f32, "DB_part": f32,
                "dy_row_stride": "i32", "x_row_stride": "i32", "n_rows": "i32", "N": "i32",
                "rows_per_program": "i32", "HAS_W": "constexpr", "BLOCK_N": "constexpr"}
    for kernel, signature, constexprs, num_warps in [
        (tln._forward_kernel, forward, {"HAS_W": True, "HAS_B": True, "BLOCK_N": block}, warps),
        (tln._backward_kernel, backward, {"HAS_W": True, "BLOCK_N": block}, tln._backward_warps(block, warps)),
    ]:
        source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
        options = {"num_warps": num_warps, "enable_fp_fusion": tln.FP_FUSION}  # as the launches in tln pass them
        compiled = triton.compile(source, target=GPUTarget(*HOPPER), options=options)
        assert compiled.asm["cubin"] and ".target sm_90" in compiled.asm["ptx"]


def test_backward_grid_fills_the_gpu_once(monkeypatch):
    """The backward's programs: all resident at once on an H200 (132 SMs), from the registers one needs; rows
    wider than 8192 columns get 16 warps; small inputs keep MIN_BAND rows per program."""
    from types import SimpleNamespace

    from normlab.kernels import triton_layer_norm as tln

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    cuda = torch.device("cuda")

    def grid(rows, hidden):
        block, warps = tln._block(torch.empty(1, hidden, dtype=torch.bfloat16))
        warps = tln._backward_warps(block, warps)
        return warps, tln._backward_programs(cuda, rows, block, warps)

    assert grid(16384, 4096) == (8, 132)  # ~200 registers x 256 threads: one program per SM
    assert grid(16384, 8192) == (16, 132)
    assert grid(16384, 1024) == (4, 4 * 132)
    assert grid(2048, 128)[1] == 2048 // tln.MIN_BAND
    assert grid(3, 128)[1] == 1


# ------------------------------------------------------------------------------------------------------------
# on a GPU: the registered Triton backend against torch's LayerNorm (skipped without one)
# ------------------------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton backend's device)")


@pytest.fixture
def triton_backend():
    import normlab.kernels

    before = normlab.kernels.backends("cuda")["normlab::layer_norm"]
    got = normlab.kernels.enable("auto", "cuda")["normlab::layer_norm"]
    assert got == "triton", normlab.kernels.unavailable("cuda")
    yield
    normlab.kernels.enable("auto" if before == "triton" else "reference", "cuda")


@needs_cuda
@pytest.mark.parametrize("hidden", [128, 1000, 4096])
def test_cuda_backend_against_torch(triton_backend, hidden):
    """fp32, and float32 parameters under bf16 autocast with float32 and bf16 inputs (what training runs), eager and
    compiled (inductor, fullgraph), with torch.library.opcheck on CUDA tensors."""
    import torch.nn.functional as F

    from model.norms import CustomLayerNorm

    torch.manual_seed(0)
    ours = CustomLayerNorm(hidden, device="cuda")
    with torch.no_grad():
        ours.weight.normal_(1.0, 0.5), ours.bias.normal_(0.0, 0.5)
    compiled = torch.compile(ours, fullgraph=True)
    for dtype in (torch.float32, torch.bfloat16):
        x = (2 * torch.randn(8, 64, hidden, device="cuda") + 0.5).to(dtype)
        want = F.layer_norm(x.double(), (hidden,), ours.weight.double(), ours.bias.double(), ours.eps)
        tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps * want.abs().max().item()
        for module in (ours, compiled):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = module(x)
            assert y.dtype == dtype
            torch.testing.assert_close(y.double(), want, atol=tol, rtol=0)
        c = torch.randn(x.shape, device="cuda")  # the loss sum(y * c): an output gradient independent of y
        xg = x.detach().requires_grad_(True)
        ours.weight.grad = ours.bias.grad = None
        (ours(xg).float() * c).sum().backward()
        params = [t.detach().double().requires_grad_(True) for t in (x, ours.weight, ours.bias)]
        (F.layer_norm(params[0], (hidden,), params[1], params[2], ours.eps) * c.double()).sum().backward()
        for got, ref in zip((xg.grad, ours.weight.grad, ours.bias.grad), (p.grad for p in params)):
            rel = 1e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps  # (dy reaches bf16 y rounded)
            torch.testing.assert_close(got.double(), ref, atol=rel * ref.abs().max().item(), rtol=0)
        w = ours.weight.detach().clone().requires_grad_(True)
        torch.library.opcheck(torch.ops.normlab.layer_norm, (x[:2].detach().requires_grad_(True), w, None, 1e-5))
