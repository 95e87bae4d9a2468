"""Section 1: CustomLayerNorm (the operator normlab::layer_norm) forward+backward time over torch.nn.LayerNorm's,
on each implementation of the operator on the device, at training shapes."""

import math
import statistics

import torch

from normlab.bench.timer import interleaved_medians, timed

GOAL = 1.0  # CustomLayerNorm's time / torch's, at most
OP = "normlab::layer_norm"
LN_LENGTHS = (16, 32, 64)  # sequence lengths of the LayerNorm shapes (B, L, D); SST-2 batches span ~10..64
LN_WIDTHS = (128, 256)  # the default model's hidden size, and the bigger width
LN_CUDA_SHAPES = ((16, 512, 1024), (8, 1024, 4096))  # rows wide enough to keep a GPU busy


def ln_settings(device) -> list[tuple[str, torch.dtype, torch.dtype | None]]:
    """(label, input dtype, autocast dtype) of the LayerNorm measurements; parameters are always float32."""
    if device.type != "cuda":
        return [("float32", torch.float32, None)]
    return [("float32", torch.float32, None),
            ("bf16-autocast", torch.float32, torch.bfloat16),  # the residual stream under autocast stays float32
            ("bf16-autocast-bf16-input", torch.bfloat16, torch.bfloat16)]  # a branch output (sandwich's norms)


def ln_shapes(device, quick: bool, batch: int) -> list[tuple[int, int, int]]:
    lengths = (32,) if quick else LN_LENGTHS
    shapes = [(batch, L, d) for d in LN_WIDTHS for L in lengths]
    return shapes + (list(LN_CUDA_SHAPES) if device.type == "cuda" else [])


def _ln_contestants(x, autocast, device):
    """torch.nn.LayerNorm and CustomLayerNorm (float32 parameters), each: one forward (under autocast when asked)
    and its backward. (Under autocast torch's returns float32 where ours keeps a bf16 input's dtype: each gets an
    output gradient of its own output's dtype, made beforehand.)"""
    from model.norms import CustomLayerNorm

    hidden = x.shape[-1]
    dy = torch.randn(x.shape, device=device)
    dys = {dt: dy.to(dt) for dt in (torch.float32, torch.bfloat16, x.dtype)}

    def make(mod):
        def run():
            x.grad = None
            mod.weight.grad = mod.bias.grad = None
            with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
                y = mod(x)
            y.backward(dys[y.dtype])
        return run

    return make(torch.nn.LayerNorm(hidden, device=device)), make(CustomLayerNorm(hidden, device=device))


def _measure(setting, shape, select: dict, training_backend: str, device, repeats: int) -> list[dict]:
    """One row per backend of the operator at one setting and shape: its median time over torch's, interleaved."""
    label, dtype, autocast = setting
    torch.manual_seed(0)
    x = torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)
    torch_fn, custom_fn = _ln_contestants(x, autocast, device)
    contestants = {"torch": torch_fn, **{b: custom_fn for b in select}}
    for b, fn in contestants.items():  # warm-up (CUDA: Triton compiles the kernels here)
        if b in select:
            select[b]()
        for _ in range(3):
            fn()
    # calibrate: about 2 ms of the reference's work per timed sample
    inner = max(1, min(200, int(0.002 / max(timed(torch_fn, device, 10), 1e-7))))
    times = interleaved_medians(contestants, repeats, device, inner, setups=select)
    t_ref = statistics.median(times["torch"])
    rows = []
    for b in select:
        t = statistics.median(times[b])
        paired = statistics.median(p / q for p, q in zip(times[b], times["torch"]))
        rows.append({"setting": label, "dtype": str(dtype).replace("torch.", ""),
                     "autocast": str(autocast).replace("torch.", "") if autocast else None,
                     "shape": list(shape), "backend": b, "custom_us": t * 1e6, "torch_us": t_ref * 1e6,
                     "ratio": t / t_ref, "paired_ratio_median": paired, "training_default": b == training_backend})
    return rows


def _geomeans(rows: list[dict]) -> dict:
    """Geometric mean of the ratios per setting, backend and width."""
    groups = {}
    for r in rows:
        groups.setdefault(f"{r['setting']}/{r['backend']}/hidden {r['shape'][-1]}", []).append(r["ratio"])
    return {k: math.exp(statistics.mean(math.log(v) for v in vs)) for k, vs in groups.items()}


def bench_layernorm(device, shapes, repeats: int) -> dict:
    """Per setting and shape: torch.nn.LayerNorm and CustomLayerNorm on each backend of normlab::layer_norm (the
    reference, and the fast one `train.kernels=auto` registers here), interleaved; the fast one stays registered."""
    import normlab.kernels

    def switch_to(mode):  # untimed, before each sample: which implementation of the operator runs
        return lambda: normlab.kernels.enable(mode, device)

    training_backend = normlab.kernels.enable("auto", device)[OP]
    select = {"reference": switch_to("reference")}
    if training_backend != "reference":
        select[training_backend] = switch_to("auto")
    rows = [r for setting in ln_settings(device) for shape in shapes
            for r in _measure(setting, shape, select, training_backend, device, repeats)]
    normlab.kernels.enable("auto", device)
    geomean = _geomeans(rows)
    return {"what": "CustomLayerNorm fwd+bwd time / torch.nn.LayerNorm fwd+bwd time (lower is better)",
            "goal": f"<= {GOAL}", "training_path": training_backend, "backends": list(select),
            "unavailable": normlab.kernels.unavailable(device), "rows": rows, "geomean_ratio": geomean,
            "training_ratio": {label: geomean.get(f"{label}/{training_backend}/hidden {LN_WIDTHS[0]}")
                               for label, _, _ in ln_settings(device)}}
