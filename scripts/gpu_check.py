"""The Python parts of scripts/gpu_check.sh (one prepared check of NormLab's GPU paths).

    python scripts/gpu_check.py kernels --device cuda --out DIR/kernels.json
    python scripts/gpu_check.py summarize --out DIR/runs.json RUN_DIR [RUN_DIR ...]
    python scripts/gpu_check.py environment [WHEEL ...]

`kernels`: CustomLayerNorm on the fast backend `train.kernels=auto` registers (on CUDA it must be Triton, and a
profile must show its kernels launched) and torch.nn.LayerNorm against float64 truth, in float32 and under bf16
autocast at training shapes; then a NormLab forward under bf16 and fp16 autocast with a fully padded sequence in
the batch (packed and padded layouts, eval and training, SDPA and the written-out attention): every output must be
finite. Exit code 1 when a check fails.
`summarize`: per run directory the status, steps, wall time, median real tokens/s, final accuracy and the dtype of
the BN family's running statistics in final/model.safetensors (float32 expected), as JSON.
`environment`: versions, the GPU, and the requirements of the carried wheels (scripts/gpu_prepare.py) that the
installed versions do not meet.
"""

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

import torch

from common.io import atomic_write_json, read_json, read_jsonl

# (batch, length, hidden): the default model's shapes, and one above CustomLayerNorm's threshold for compiled kernels
LN_SHAPES = ((32, 64, 128), (64, 128, 256))
FP32_TOL = 1e-5  # float32: max error relative to the largest reference value
# the kernels each fast backend launches, by name in a profile (what proves that backend ran, not the reference)
FAST_KERNEL_NAMES = {"triton": ("_forward_kernel", "_backward_kernel")}


def _ln_outputs(ln, h, dy, autocast: bool):
    """y, dL/dh, dL/dweight, dL/dbias of LayerNorm `ln` at input h (detached) for the loss sum(y * dy)."""
    h = h.detach().requires_grad_(True)
    with torch.autocast(h.device.type, dtype=torch.bfloat16, enabled=autocast):
        y = ln(h)
    return (y, *torch.autograd.grad((y.double() * dy).sum(), [h, ln.weight, ln.bias]))


def _profiled_kernels(fn) -> set[str]:
    """Names of the GPU kernels fn() launches."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}


def _bounds(errs, scale, mode, ulp) -> dict:
    """float32: FP32_TOL at the reference's scale. bf16: twice torch's own error plus units in the last place of
    bf16 at the reference's scale, as tests/test_triton_layer_norm.py judges the kernels: one for y, two for the
    gradients (the output gradient reaches our bf16 y rounded to bf16). Under CUDA autocast torch normalizes in
    float32 and returns float32, so its own error is near zero: the bound is then bf16's rounding alone."""
    if mode == "float32":
        return {k: FP32_TOL * scale[k] for k in scale}
    return {k: 2 * errs["torch"][k] + (1 if k == "y" else 2) * ulp * scale[k] for k in scale}


def check_layernorm(device) -> list[dict]:
    """CustomLayerNorm on the fast backend `train.kernels=auto` registers (Triton on CUDA: required there) and
    torch.nn.LayerNorm, against the float64 LayerNorm of the same input, in float32 and under bf16 autocast
    (input: the bf16 output of a Linear, as in the model)."""
    import normlab_kernels
    from model.norms import CustomLayerNorm

    backend = normlab_kernels.enable("auto", device)["normlab::layer_norm"]
    rows = [{"check": "fast_backend_registered", "backend": backend, "ok": device.type != "cuda" or
             backend == "triton", "unavailable": normlab_kernels.unavailable(device)}]
    keys = ("y", "dx", "dweight", "dbias")
    for (B, L, D) in LN_SHAPES:
        for mode in ("float32", "bf16_autocast"):
            torch.manual_seed(0)
            autocast = mode == "bf16_autocast"
            proj = torch.nn.Linear(D, D, device=device)
            lns = {"ours": CustomLayerNorm(D, device=device), "torch": torch.nn.LayerNorm(D, device=device),
                   "float64": torch.nn.LayerNorm(D, device=device, dtype=torch.float64)}
            with torch.no_grad():
                for ln in lns.values():
                    ln.weight.copy_(torch.linspace(0.5, 1.5, D)), ln.bias.copy_(torch.linspace(-0.2, 0.2, D))
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    h = proj(torch.randn(B, L, D, device=device) * 3 + 1)  # bf16 under autocast
            dy = torch.randn(B, L, D, device=device, dtype=torch.float64)
            ref = _ln_outputs(lns["float64"], h.double(), dy, autocast=False)
            scale = {k: r.abs().max().item() for k, r in zip(keys, ref)}
            errs, dtypes = {}, {}
            for name in ("ours", "torch"):
                outs = _ln_outputs(lns[name], h, dy, autocast)
                errs[name] = {k: (o.double() - r).abs().max().item() for k, o, r in zip(keys, outs, ref)}
                dtypes[name] = str(outs[0].dtype)
            bound = _bounds(errs, scale, mode, torch.finfo(h.dtype).eps)
            ok = all(errs["ours"][k] <= bound[k] for k in keys) and (autocast or all(
                errs["torch"][k] <= bound[k] for k in keys))
            row = {"check": "custom_layernorm_vs_float64", "shape": [B, L, D], "mode": mode, "backend": backend,
                   "max_abs_err": errs, "bound": bound, "scale": scale, "y_dtype": dtypes}
            if backend in FAST_KERNEL_NAMES:
                try:
                    launched = _profiled_kernels(lambda: _ln_outputs(lns["ours"], h, dy, autocast))
                except Exception as err:  # noqa: BLE001 - no profiler: this row fails, the other checks still run
                    launched, row["profiler_error"] = set(), f"{type(err).__name__}: {err}"
                row["fast_kernels_ran"] = all(any(k in n for n in launched) for k in FAST_KERNEL_NAMES[backend])
                ok = ok and row["fast_kernels_ran"]
            rows.append({**row, "ok": ok})
    return rows


def check_padded_row(device) -> list[dict]:
    from model import NormLabConfig, NormLabForSequenceClassification

    rows = []
    torch.manual_seed(0)
    config = NormLabConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=128, max_position_embeddings=32, num_labels=2)
    model = NormLabForSequenceClassification(config).to(device)
    ids = torch.randint(1, 100, (4, 16), device=device)
    mask = torch.ones(4, 16, dtype=torch.long, device=device)
    mask[1] = 0  # a sequence that is all padding
    mask[2, 5:] = 0
    for dtype in (torch.bfloat16, torch.float16):
        for unpad in (True, False):
            for train in (False, True):
                for attentions in (False, True):
                    model.normlab.unpad = unpad
                    model.train(train)
                    with torch.autocast(device.type, dtype=dtype), torch.set_grad_enabled(train):
                        out = model(input_ids=ids * mask, attention_mask=mask, labels=torch.tensor([0, 1, 0, 1],
                                    device=device), output_hidden_states=True, output_attentions=attentions)
                    tensors = [out.logits, out.loss, *out.hidden_states, *(out.attentions or ())]
                    finite = all(torch.isfinite(t).all().item() for t in tensors)
                    if train:
                        out.loss.backward()
                        finite = finite and all(torch.isfinite(p.grad).all().item() for p in model.parameters()
                                                if p.grad is not None)
                        model.zero_grad(set_to_none=True)
                    rows.append({"check": "fully_padded_row_finite", "dtype": str(dtype), "unpad": unpad,
                                 "train": train, "output_attentions": attentions, "ok": finite})
    return rows


def kernels(args) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check.py: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    rows = check_layernorm(device) + check_padded_row(device)
    info = {"device": str(device), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    atomic_write_json(args.out, {"info": info, "checks": rows}, indent=1)
    failed = [r for r in rows if not r["ok"]]
    for r in rows:
        print(("ok    " if r["ok"] else "FAIL  ") + json.dumps({k: v for k, v in r.items() if k != "ok"}))
    print(f"{len(rows) - len(failed)}/{len(rows)} checks passed")
    return 1 if failed else 0


def summarize_run(run: Path) -> dict:
    summary = read_json(run / "summary.json", {})
    rows = read_jsonl(run / "metrics.jsonl")
    tps = [r["train/tokens_per_s"] for r in rows if r.get("train/tokens_per_s") is not None]
    out = {"run": run.name, "status": summary.get("status", "missing"), "steps": summary.get("step"),
           "wall_time_s": summary.get("wall_time_s"), "step_time_s": summary.get("step_time_s"),
           "tokens_per_s_median": statistics.median(tps) if tps else None,
           "final_eval_accuracy": (summary.get("final") or {}).get("eval/accuracy"),
           "final_eval_loss": (summary.get("final") or {}).get("eval/loss"),
           "num_processes": summary.get("num_processes")}
    weights = run / "final" / "model.safetensors"
    if weights.exists():
        from safetensors import safe_open

        with safe_open(str(weights), "pt") as f:
            stats = {f.get_slice(k).get_dtype() for k in f.keys() if k.rsplit(".", 1)[-1] in
                     ("running_mean", "running_var", "running_psi2", "ema_gz")}
        out["running_stats_dtypes"] = sorted(stats) or None
    return out


def summarize(args) -> int:
    runs = [summarize_run(Path(p)) for p in args.runs]
    atomic_write_json(args.out, runs, indent=1)
    for r in runs:
        print(json.dumps(r))
    bad = [r for r in runs if r["status"] != "completed" or r.get("running_stats_dtypes") not in (None, ["F32"])]
    return 1 if bad else 0


REPORTED = ("torch", "triton", "transformers", "accelerate", "tokenizers", "datasets", "omegaconf", "pyarrow",
            "pandas", "fsspec", "huggingface-hub", "numpy", "pytest")


def _unmet(dist_name: str) -> list[str]:
    """The requirements of an installed distribution that the installed versions do not meet (the carried wheels
    were installed without dependency resolution: this says whether the image's versions suit them)."""
    from importlib import metadata as md

    from packaging.requirements import Requirement

    unmet = []
    for text in md.requires(dist_name) or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            have = None
        if have is None or not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{dist_name} needs {text} (installed: {have})")
    return unmet


def environment(args) -> int:
    """Versions, the GPU, and whether the carried wheels' requirements are met here (informational: exit 0)."""
    from importlib import metadata as md

    print("python", platform.python_version(), sys.executable)
    for name in REPORTED:
        try:
            print(name, md.version(name))
        except md.PackageNotFoundError:
            print(name, "missing")
    print("cuda available", torch.cuda.is_available(), torch.version.cuda,
          torch.cuda.get_device_name() if torch.cuda.is_available() else "")
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        print("multiprocessors", props.multi_processor_count, "memory GiB", round(props.total_memory / 2**30, 1))
    carried = sorted({Path(w).name.split("-")[0] for w in args.wheels})
    problems = [u for name in carried for u in _unmet(name)]
    print("carried wheels:", ", ".join(carried) or "none")
    print("\n".join(problems) if problems else "their requirements: all met")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kernels", help="CustomLayerNorm vs torch, and a fully padded row under autocast")
    k.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    k.add_argument("--out", required=True)
    s = sub.add_parser("summarize", help="wall time, tokens/s, accuracy of finished runs")
    s.add_argument("--out", required=True)
    s.add_argument("runs", nargs="+")
    e = sub.add_parser("environment", help="versions, the GPU, the carried wheels' unmet requirements")
    e.add_argument("wheels", nargs="*", help="the carried wheel files")
    args = ap.parse_args(argv)
    return {"kernels": kernels, "summarize": summarize, "environment": environment}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
