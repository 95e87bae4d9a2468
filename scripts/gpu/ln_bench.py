"""LayerNorm kernels against the memory system: NormLab's normlab::layer_norm (the backend `train.kernels=auto`
registers: Triton on CUDA, C++ on CPU) and torch's LayerNorm, eager and compiled, float32 and bf16, with the
bandwidth each achieves next to a device-to-device copy measured in the same run.

    python scripts/gpu/ln_bench.py [--device cuda|cpu] [--quick] [--no-compile] [--out FILE]

Eager at every shape and dtype; compiled (torch.compile, inductor) at COMPILED only: each compiled contestant is two
cold builds (forward, forward+backward), tens of seconds each. Bytes counted are the fewest a pass must move
(forward: x read, y written; backward: x and dy read, dx written); the backward's time is forward+backward minus
forward. Every row also records its maximum error against torch's LayerNorm in float64 (y and the gradients of x,
weight and bias), and NormLab's rows must stay within gpu_check.py's bounds of torch's own error at that dtype
(exit code 1 otherwise). The JSON file is rewritten after every row: a run cut short keeps what it measured.
"""

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F
from gpu_check import LN_KEYS, layernorm_bounds, layernorm_errors, layernorm_outputs, layernorm_truth

from normlab.bench.timer import timed
from normlab.files.formats import atomic_write_json

SHAPES = ((16384, 1024), (16384, 4096), (8192, 8192))  # (rows, hidden): each tensor well over the H200's 60 MB L2
QUICK_SHAPES = ((64, 128), (32, 1000))
COMPILED = ((16384, 4096), torch.bfloat16)  # the one shape and dtype timed compiled: training's dtype
EPS = 1e-5
COPY_BYTES = 2**30


def median_seconds(fn, device, quick: bool) -> float:
    """Median time of fn(): CUDA events through triton.testing.do_bench; on CPU the bench's wall-clock sample."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3
    fn()
    return statistics.median([timed(fn, device) for _ in range(3 if quick else 20)])


def copy_bandwidth(device, quick: bool) -> float:
    """Bytes read + written per second by a device-to-device copy of COPY_BYTES (the ceiling to compare with)."""
    n = (2**20 if quick else COPY_BYTES) // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / median_seconds(lambda: dst.copy_(src), device, quick)


def _functions(impl: str, compiled: bool):
    def ours(x, w, b):
        return torch.ops.normlab.layer_norm(x, w, b, EPS)[0]

    def theirs(x, w, b):
        return F.layer_norm(x, x.shape[-1:], w, b, EPS)

    fn = ours if impl == "normlab" else theirs
    return torch.compile(fn, dynamic=False) if compiled else fn


def measure(impl, compiled, rows, hidden, dtype, device, quick, truth=None) -> tuple[dict, tuple]:
    """Forward and forward+backward times of one contestant at one shape and dtype, with achieved bandwidth, and
    its maximum errors against `truth` (layernorm_truth of the same inputs)."""
    torch.manual_seed(0)
    x = (2 * torch.randn(rows, hidden, device=device) + 0.5).to(dtype)
    w = (1 + 0.5 * torch.randn(hidden, device=device)).requires_grad_(True)
    b = (0.5 * torch.randn(hidden, device=device)).requires_grad_(True)
    dy = torch.randn(rows, hidden, device=device).to(dtype)
    xg = x.detach().requires_grad_(True)
    fn = _functions(impl, compiled)

    def forward():
        with torch.no_grad():
            fn(x, w, b)

    def forward_backward():
        torch.autograd.grad(fn(xg, w, b), (xg, w, b), dy)

    fwd = median_seconds(forward, device, quick)
    both = median_seconds(forward_backward, device, quick)
    size = rows * hidden * x.element_size()
    bwd = max(both - fwd, 1e-12)
    truth = truth or layernorm_truth(x, w, b, dy, EPS)
    return {"impl": impl, "compiled": compiled, "shape": [rows, hidden], "dtype": str(dtype).replace("torch.", ""),
            "forward_us": fwd * 1e6, "forward_backward_us": both * 1e6, "backward_us": bwd * 1e6,
            "forward_GBps": 2 * size / fwd / 1e9, "backward_GBps": 3 * size / bwd / 1e9,
            "max_abs_err": layernorm_errors(layernorm_outputs(fn, x, w, b, dy), truth)}, truth


def contestants(quick: bool, compile_too: bool):
    """(compiled, rows, hidden, dtype) in the order measured: eager everywhere, then compiled at COMPILED."""
    for rows, hidden in QUICK_SHAPES if quick else SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            yield False, rows, hidden, dtype
    if compile_too:
        (rows, hidden), dtype = COMPILED if not quick else (QUICK_SHAPES[0], torch.bfloat16)
        yield True, rows, hidden, dtype


def judge(ours: dict, theirs: dict, truth) -> None:
    """NormLab's row ok when within layernorm_bounds of torch's row (same shape, dtype and compilation)."""
    bound = layernorm_bounds(theirs["max_abs_err"], truth, getattr(torch, ours["dtype"]))
    ours["bound"] = bound
    ours["ok"] = all(ours["max_abs_err"][k] <= bound[k] for k in LN_KEYS)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small shapes, few repeats (tests): numbers not meaningful")
    ap.add_argument("--no-compile", action="store_true", help="eager contestants only")
    ap.add_argument("--out", default=None, help="write the JSON here (rewritten after every row)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    import normlab.kernels

    backend = normlab.kernels.enable("auto", device)["normlab::layer_norm"]
    copy = copy_bandwidth(device, args.quick)
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "backend": backend,
           "torch": torch.__version__, "copy_GBps": copy / 1e9, "rows": []}
    print(f"backend {backend}; copy {copy / 1e9:.0f} GB/s (read + written)")
    for compiled, rows, hidden, dtype in contestants(args.quick, not args.no_compile):
        truth = None
        for impl in ("torch", "normlab"):
            r, truth = measure(impl, compiled, rows, hidden, dtype, device, args.quick, truth)
            r["forward_of_copy"] = r["forward_GBps"] * 1e9 / copy
            r["backward_of_copy"] = r["backward_GBps"] * 1e9 / copy
            if impl == "normlab":
                judge(r, res["rows"][-1], truth)
            res["rows"].append(r)
            if args.out:
                atomic_write_json(args.out, res, indent=1)
            print(f"{impl:8s} {'compiled' if compiled else 'eager':8s} {rows}x{hidden} {r['dtype']:8s} "
                  f"fwd {r['forward_us']:9.1f} us ({r['forward_of_copy']:4.0%} of copy)  "
                  f"bwd {r['backward_us']:9.1f} us ({r['backward_of_copy']:4.0%} of copy)  "
                  f"max err y {r['max_abs_err']['y']:.1e} dx {r['max_abs_err']['dx']:.1e}"
                  f"{'' if r.get('ok', True) else '  FAIL: over ' + str(r['bound'])}", flush=True)
    failed = [r for r in res["rows"] if r.get("ok") is False]
    if failed:
        print(f"error: {len(failed)} NormLab rows beyond torch's own error (see 'bound' in the JSON)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
