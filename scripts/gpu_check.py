"""The Python parts of scripts/gpu_check.sh (one prepared check of NormLab's GPU paths).

    python scripts/gpu_check.py kernels --device cuda --out DIR/kernels.json
    python scripts/gpu_check.py summarize --out DIR/runs.json RUN_DIR [RUN_DIR ...]
    python scripts/gpu_check.py wheels --dest .whl        # on a machine with the package registry

`kernels`: CustomLayerNorm against torch.nn.LayerNorm (forward and gradients) in float32 and under bf16 autocast at
training shapes and at a size that takes the compiled path, then a NormLab forward under bf16 and fp16 autocast
with a fully padded sequence in the batch (packed and padded layouts, eval and training, SDPA and the written-out
attention): every output must be finite. Exit code 1 when a check fails.
`summarize`: per run directory the status, steps, wall time, median real tokens/s, final accuracy and the dtype of
the BN family's running statistics in final/model.safetensors (float32 expected), as JSON.
`wheels`: the wheels `datasets` needs beyond what torch, transformers, accelerate, tokenizers and triton install, at
the versions installed here (pyarrow: the oldest datasets accepts, the smallest wheel), for a GPU machine that
has no `datasets` and no package registry; gpu_check.sh installs them from that folder.
"""

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.io import atomic_write_json, read_json, read_jsonl  # noqa: E402

# (batch, length, hidden): the default model's shapes, and one above CustomLayerNorm's threshold for compiled kernels
LN_SHAPES = ((32, 64, 128), (64, 128, 256))
FP32_TOL = 1e-5  # float32: max error relative to the largest reference value
WORSE_THAN_TORCH = 2.0  # under bf16 autocast: our error may be at most this multiple of torch's (or FP32_TOL)


def _rel_err(a, ref) -> float:
    return ((a.double() - ref).abs().max() / ref.abs().max().clamp(min=1.0)).item()


def _ln_outputs(ln, h, dy, autocast: bool):
    """y, dL/dh, dL/dweight, dL/dbias of LayerNorm `ln` at input h (detached) for the loss sum(y * dy)."""
    h = h.detach().requires_grad_(True)
    with torch.autocast(h.device.type, dtype=torch.bfloat16, enabled=autocast):
        y = ln(h)
    return (y, *torch.autograd.grad((y.double() * dy).sum(), [h, ln.weight, ln.bias]))


def check_layernorm(device) -> list[dict]:
    """CustomLayerNorm and torch.nn.LayerNorm against the float64 LayerNorm of the same input. In float32 both
    must match it to FP32_TOL; under bf16 autocast (input: the bf16 output of a Linear, as in the model) ours must be
    within WORSE_THAN_TORCH times torch's own error."""
    from model.norms import CustomLayerNorm

    rows = []
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
            errs = {}
            for name in ("ours", "torch"):
                outs = _ln_outputs(lns[name], h, dy, autocast)
                errs[name] = {k: _rel_err(o, r) for k, o, r in zip(("y", "dx", "dweight", "dbias"), outs, ref)}
                errs[name]["dtype"] = str(outs[0].dtype)
            bound = {k: (FP32_TOL if not autocast else max(FP32_TOL, WORSE_THAN_TORCH * errs["torch"][k]))
                     for k in ("y", "dx", "dweight", "dbias")}
            ok = all(errs["ours"][k] <= bound[k] for k in bound) and (autocast or all(
                errs["torch"][k] <= FP32_TOL for k in bound))
            rows.append({"check": "custom_layernorm_vs_torch", "shape": [B, L, D], "mode": mode, "ok": ok,
                         "rel_err_vs_float64": errs, "bound": bound})
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


GPU_MACHINE_HAS = ("torch", "transformers", "accelerate", "tokenizers", "triton")


def _requirement_closure(names) -> dict:
    """{distribution: installed version} for `names` and everything they require (extras of a requirement, like
    fsspec[http], are not followed: gpu_check.sh installs the wheels without dependency resolution)."""
    import importlib.metadata as md

    found, stack = {}, list(names)
    while stack:
        name = re.sub(r"[-_.]+", "-", stack.pop()).lower()
        if name in found:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        found[name] = dist.version
        for req in dist.requires or []:
            if "extra ==" not in req:  # an optional dependency
                stack.append(re.match(r"[A-Za-z0-9_.\-]+", req).group(0))
    return found


def wheels(args) -> int:
    import importlib.metadata as md

    need = {k: v for k, v in _requirement_closure(["datasets"]).items()
            if k not in _requirement_closure(GPU_MACHINE_HAS)}
    floor = [r for r in md.requires("datasets") if re.match(r"pyarrow\s*>=", r)]
    if "pyarrow" in need and floor:
        need["pyarrow"] = floor[0].split(">=")[1].split(",")[0].strip()
    pins = [f"{k}=={v}" for k, v in sorted(need.items())]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d", args.dest, *pins]
    if args.python_version:
        cmd[4:4] = ["--python-version", args.python_version]
    print(" ".join(cmd[2:]))
    rc = subprocess.run(cmd).returncode
    size = sum(f.stat().st_size for f in Path(args.dest).glob("*.whl"))
    print(f"{args.dest}: {size / 2**20:.1f} MiB of wheels")
    return rc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kernels", help="CustomLayerNorm vs torch, and a fully padded row under autocast")
    k.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    k.add_argument("--out", required=True)
    s = sub.add_parser("summarize", help="wall time, tokens/s, accuracy of finished runs")
    s.add_argument("--out", required=True)
    s.add_argument("runs", nargs="+")
    w = sub.add_parser("wheels", help="download the wheels datasets needs on a GPU machine without it")
    w.add_argument("--dest", default=".whl")
    w.add_argument("--python-version", default=None, help="the GPU machine's Python, e.g. 3.12 (default: this one's)")
    args = ap.parse_args(argv)
    return {"kernels": kernels, "summarize": summarize, "wheels": wheels}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
