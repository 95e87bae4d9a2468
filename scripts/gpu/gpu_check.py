"""The Python parts of scripts/gpu/gpu_check.sh (one prepared check of NormLab's GPU paths).

    python scripts/gpu/gpu_check.py kernels --device cuda --out DIR/kernels.json [--columns 128 1000 4096 8192]
    python scripts/gpu/gpu_check.py summarize --out DIR/runs.json RUN_DIR [RUN_DIR ...]
    python scripts/gpu/gpu_check.py environment [WHEEL ...]

`kernels`: CustomLayerNorm's operator on the fast backend `train.kernels=auto` registers (on CUDA it must be Triton,
and a profile must show its kernels launched) against float64 truth, in float32, bfloat16 and float16 (parameters
float32, as in training) at 128, 1000, 4096 and 8192 columns, with zero (padding) rows: y and the gradients of x,
weight and bias within twice torch's own error at that dtype plus one or two units in its last place; then a
NormLab forward under bf16 and fp16 autocast with a fully padded sequence in the batch (packed and padded layouts,
eval and training, SDPA and the written-out attention): every output must be finite. Exit code 1 when a check fails.
`summarize`: per run directory the status, steps, wall time, median real tokens/s, final accuracy and the dtype of
the BN family's running statistics in final/model.safetensors (float32 expected), as JSON.
`environment`: versions, the GPU, and the requirements of the carried wheels (scripts/gpu/gpu_prepare.py) that the
installed versions do not meet.
"""

import argparse
import importlib.metadata as md
import json
import os
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from normlab.files.formats import atomic_write_json
from normlab.run_dir import RunDir
from normlab.train.run_summary import tokens_per_s

# CustomLayerNorm's check: the dtypes training runs in, and hidden sizes from the default model's to the widest the
# Triton kernel takes in one block at 16-bit (8192: 16 warps in the backward); (batch, length) rows with padding
LN_DTYPES = ("float32", "bfloat16", "float16")
LN_COLUMNS = (128, 1000, 4096, 8192)
LN_ROWS = (3, 61)  # 183 rows: not a whole number of the backward's bands
LN_KEYS = ("y", "dx", "dweight", "dbias")
# the kernels each fast backend launches, by name in a profile (what proves that backend ran, not the reference)
FAST_KERNEL_NAMES = {"triton": ("_forward_kernel", "_backward_kernel")}


def layernorm_inputs(rows, hidden, dtype, device, seed=0):
    """x (rows + (hidden,), in dtype) whose last sequence ends in padding (zero rows, with a zero output gradient, as
    a padded position gets), float32 weight and bias (training's parameters), and dy in dtype."""
    gen = torch.Generator().manual_seed(seed)
    x = 2 * torch.randn(*rows, hidden, generator=gen) + 0.5
    dy = torch.randn(*rows, hidden, generator=gen)
    x[-1, rows[-1] * 2 // 3:] = 0
    dy[-1, rows[-1] * 2 // 3:] = 0
    w = 1 + 0.5 * torch.randn(hidden, generator=gen)
    b = 0.5 * torch.randn(hidden, generator=gen)
    return x.to(device, dtype), w.to(device), b.to(device), dy.to(device, dtype)


def layernorm_outputs(fn, x, w, b, dy) -> tuple:
    """y, dL/dx, dL/dw, dL/db of y = fn(x, w, b) for the loss sum(y * dy)."""
    x, w, b = (t.detach().requires_grad_(True) for t in (x, w, b))
    y = fn(x, w, b)
    return (y.detach(), *torch.autograd.grad(y, (x, w, b), dy))


def torch_layer_norm(x, w, b, eps=1e-5):
    """torch's LayerNorm with its parameters in the input's dtype: its own error at that dtype (the yardstick)."""
    return F.layer_norm(x, x.shape[-1:], w.to(x.dtype), b.to(x.dtype), eps)


def layernorm_errors(outputs, truth) -> dict:
    """Max absolute error of each of y, dx, dweight, dbias against the float64 truth."""
    return {k: (o.double() - t).abs().max().item() for k, o, t in zip(LN_KEYS, outputs, truth)}


def layernorm_truth(x, w, b, dy, eps=1e-5) -> tuple:
    return layernorm_outputs(lambda *a: F.layer_norm(a[0], a[0].shape[-1:], a[1], a[2], eps),
                             *(t.double() for t in (x, w, b, dy)))


def layernorm_bounds(torch_errs: dict, truth, dtype) -> dict:
    """Twice torch's own error plus units in the last place of the dtype at the truth's scale: one for y, two for
    the gradients (the output gradient reaches y rounded to the dtype), as tests/test_triton_layer_norm.py judges
    the kernels."""
    ulp = torch.finfo(dtype).eps
    return {k: 2 * torch_errs[k] + (1 if k == "y" else 2) * ulp * t.abs().max().item()
            for k, t in zip(LN_KEYS, truth)}


def _profiled_kernels(fn) -> set[str]:
    """Names of the GPU kernels fn() launches."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}


def normlab_layer_norm(x, w, b, eps=1e-5):
    """What CustomLayerNorm's forward runs (normlab::layer_norm, on whichever backend is registered)."""
    from model.layer_norm_op import layer_norm

    return layer_norm(x, w, b, eps)[0]


def check_layernorm(device, columns=LN_COLUMNS, rows=LN_ROWS, ours=normlab_layer_norm, kernels="auto") -> list[dict]:
    """`ours` (default: CustomLayerNorm's operator on the backend `train.kernels=<kernels>` registers; for auto on
    CUDA it must be Triton) against the float64 LayerNorm of the same values, for every dtype and hidden size: y and the
    gradients of x, weight and bias within layernorm_bounds of torch's own error."""
    import normlab.kernels

    backend = normlab.kernels.enable(kernels, device)["normlab::layer_norm"]
    out = [{"check": "fast_backend_registered", "backend": backend, "ok": device.type != "cuda" or
            kernels != "auto" or backend == "triton", "unavailable": normlab.kernels.unavailable(device)}]
    for name in LN_DTYPES:
        dtype = getattr(torch, name)
        for hidden in columns:
            inputs = layernorm_inputs(rows, hidden, dtype, device)
            truth = layernorm_truth(*inputs)
            errs = {"ours": layernorm_errors(layernorm_outputs(ours, *inputs), truth),
                    "torch": layernorm_errors(layernorm_outputs(torch_layer_norm, *inputs), truth)}
            bound = layernorm_bounds(errs["torch"], truth, dtype)
            row = {"check": "custom_layernorm_vs_float64", "dtype": name, "shape": [*rows, hidden],
                   "backend": backend, "max_abs_err": errs, "bound": bound,
                   "ok": all(errs["ours"][k] <= bound[k] for k in LN_KEYS)}
            if backend in FAST_KERNEL_NAMES and hidden == columns[-1]:  # one profile per dtype
                try:
                    launched = _profiled_kernels(lambda: layernorm_outputs(ours, *inputs))
                except Exception as err:  # noqa: BLE001 - no profiler: this row fails, the other checks still run
                    launched, row["profiler_error"] = set(), f"{type(err).__name__}: {err}"
                row["fast_kernels_ran"] = all(any(k in n for n in launched) for k in FAST_KERNEL_NAMES[backend])
                row["ok"] = row["ok"] and row["fast_kernels_ran"]
            out.append(row)
    return out


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
        print("error: --device cuda but torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    rows = check_layernorm(device, columns=args.columns) + check_padded_row(device)
    info = {"device": str(device), "torch": torch.__version__, "source": os.environ.get("GPU_CHECK_SOURCE"),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    atomic_write_json(args.out, {"info": info, "checks": rows}, indent=1)
    failed = [r for r in rows if not r["ok"]]
    for r in rows:
        print(("ok    " if r["ok"] else "FAIL  ") + json.dumps({k: v for k, v in r.items() if k != "ok"}))
    print(f"{len(rows) - len(failed)}/{len(rows)} checks passed")
    return 1 if failed else 0


def summarize_run(run: Path) -> dict:
    run_dir = RunDir(run)
    summary = run_dir.read_summary() or {}
    out = {"run": run.name, "status": summary.get("status", "missing"), "steps": summary.get("step"),
           "wall_time_s": summary.get("wall_time_s"), "step_time_s": summary.get("step_time_s"),
           "tokens_per_s_median": tokens_per_s(run_dir.metrics_file),
           "final_eval_accuracy": (summary.get("final") or {}).get("eval/accuracy"),
           "final_eval_loss": (summary.get("final") or {}).get("eval/loss"),
           "num_processes": summary.get("num_processes")}
    weights = run_dir.final / "model.safetensors"
    if weights.exists():
        from safetensors import safe_open

        with safe_open(str(weights), "pt") as f:
            stats = {f.get_slice(k).get_dtype() for k in f.keys() if k.rsplit(".", 1)[-1] in
                     ("running_mean", "running_var", "running_psi2", "ema_gz")}
        out["running_stats_dtypes"] = sorted(stats) or None
        out["loads_back"] = loads_back(run_dir.final)
    return out


def loads_back(final: Path) -> bool | str:
    """True when final/ loads as a user loads it (from_pretrained of its own architecture) with every saved tensor
    in place and equal to the file's: what a launcher that shards the model (FSDP) must gather into it. Else what
    went wrong, in words."""
    from safetensors.torch import load_file

    import model as model_module

    arch = json.loads((final / "config.json").read_text())["architectures"][0]
    loaded, info = getattr(model_module, arch).from_pretrained(final, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    if problems:
        return f"from_pretrained: {problems}"
    state = loaded.state_dict()
    differ = [k for k, saved in load_file(final / "model.safetensors").items() if not torch.equal(state[k], saved)]
    return f"differ from the file: {differ[:5]}" if differ else True


def summarize(args) -> int:
    runs = [summarize_run(Path(p)) for p in args.runs]
    atomic_write_json(args.out, runs, indent=1)
    for r in runs:
        print(json.dumps(r))
    bad = [r for r in runs if r["status"] != "completed" or r.get("running_stats_dtypes") not in (None, ["F32"])
           or r.get("loads_back", True) is not True]
    return 1 if bad else 0


REPORTED = ("torch", "triton", "transformers", "accelerate", "tokenizers", "datasets", "omegaconf", "pyarrow",
            "pandas", "fsspec", "huggingface-hub", "numpy", "pytest")


def _installed(name: str) -> str | None:
    """The installed version of a distribution; None when it is not installed."""
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _unmet(dist_name: str) -> list[str]:
    """The requirements of an installed distribution that the installed versions do not meet (the carried wheels
    were installed without dependency resolution: this says whether the image's versions suit them)."""
    from packaging.requirements import Requirement

    unmet = []
    for text in md.requires(dist_name) or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        have = _installed(req.name)
        if have is None or not req.specifier.contains(have, prereleases=True):
            unmet.append(f"{dist_name} needs {text} (installed: {have})")
    return unmet


def environment(args) -> int:
    """The commit checked, versions, the GPU, and whether the carried wheels' requirements are met here
    (informational: exit 0)."""
    import shutil
    import subprocess
    import time

    print(time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "source:", os.environ.get("GPU_CHECK_SOURCE", "unknown"))
    print("python", platform.python_version(), sys.executable)
    for name in REPORTED:
        print(name, _installed(name) or "missing")
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm", "--format=csv"],
                             capture_output=True, text=True, timeout=20)
        print(smi.stdout.strip())
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
    k.add_argument("--columns", type=int, nargs="+", default=list(LN_COLUMNS),
                   help="hidden sizes of the LayerNorm check")
    s = sub.add_parser("summarize", help="wall time, tokens/s, accuracy of finished runs")
    s.add_argument("--out", required=True)
    s.add_argument("runs", nargs="+")
    e = sub.add_parser("environment", help="versions, the GPU, the carried wheels' unmet requirements")
    e.add_argument("wheels", nargs="*", help="the carried wheel files")
    args = ap.parse_args(argv)
    return {"kernels": kernels, "summarize": summarize, "environment": environment}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
