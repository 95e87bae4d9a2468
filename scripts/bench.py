"""NormLab's performance numbers, measured side by side in one run and printed as ratios.

    python scripts/bench.py [--json] [--quick] [--device cpu|cuda] [--repeats N] [--threads N] [--batches N]
                            [--compile | --no-compile] [--compile-hf] [--diagnose] [--out FILE] [--config FILE]

Four sections, each with its goal:
  1. layernorm   CustomLayerNorm (the operator normlab::layer_norm) forward+backward time / torch.nn.LayerNorm,
                 for each implementation of the operator on the device: the reference PyTorch math and the fast
                 backend `train.kernels=auto` registers (normlab_kernels: C++ on CPU, Triton on CUDA). Training
                 shapes (batch 32, lengths 16..64) at the default width 128 and at 256; on CUDA also wider rows.
                 CPU: float32. CUDA: float32, and float32 parameters under bf16 autocast with float32 inputs (the
                 residual stream) and bf16 inputs (a branch output), as GPU training runs.          Goal <= 1.0x.
  2. throughput  training throughput in real (non-pad) tokens/s of NormLabForSequenceClassification (the default
                 config's model) over HF BertForSequenceClassification of the same size (attn_implementation
                 "sdpa", same dropout rates), on the same real SST-2 length-grouped batches; full step = forward,
                 backward, grad clipping, AdamW step (the fused AdamW train.py builds, for both). NormLab eager, and compiled
                 (`model.compile()`, as train.compile=true does). Again at a bigger width (hidden 256, 4 layers,
                 4 heads, batch 32: `throughput_wide`).                                          Goal >= 1.3x.
  3. padding     pad fraction of random batches vs the length-grouped batches training uses, SST-2 train,
                 train.batch_size, epoch 0 of each sampler; counted on the collated attention masks.  Goal <= 5%.
  4. memory      peak memory of one training step, NormLab vs HF (method printed with the numbers).

Fairness: every timed contestant runs inside the same loop, interleaved with the others (LayerNorm: per timed
sample; training: per optimizer step, the order rotating), and each figure is a median over repetitions, so
machine noise (other processes, frequency changes) hits all contestants alike. Both models receive the identical
padded batches; tokens/s counts real tokens only. NormLab's packed layout (`NormLabModel.unpad`) skips pad
positions inside the model while HF computes them: the output says so (with length-grouped batches there are
few pads to skip). NormLab runs with the kernels training uses (`train.kernels=auto`; `kernels` in the output).

`--diagnose` adds NormLab with torch's LayerNorm, NormLab without unpadding, and NormLab on the reference
implementation of its operators as extra contestants.
`--quick` uses 2000 training rows, few batches and few repeats (seconds, for tests); its numbers are not
meaningful. The CUDA paths run only when torch.cuda.is_available() and are reported untested otherwise. On CUDA
the training steps (sections 2 and 4) run under bf16 autocast, as the GPU launch configs train (mixed_precision
bf16); on CPU in float32, as CPU training runs.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from common.io import atomic_write_json  # noqa: E402
from common.optim import adamw  # noqa: E402  (the optimizer train.py uses)
from common.step import MODEL_INPUTS, model_inputs, step_flags  # noqa: E402  (the step train.py takes)

GOALS = {"layernorm": 1.0, "throughput": 1.3, "padding": 0.05, "logging": 0.10}
QUICK_TRAIN_SAMPLES = 2000  # --quick: the first N training rows (tokenizer, padding and throughput batches)
LN_LENGTHS = (16, 32, 64)  # sequence lengths of the LayerNorm shapes (B, L, D); SST-2 batches span ~10..64
LN_WIDTHS = (128, 256)  # the default model's hidden size, and the bigger width
LN_CUDA_SHAPES = ((16, 512, 1024), (8, 1024, 4096))  # rows wide enough to keep a GPU busy
LN_ONLY_BATCH = 32  # --layernorm-only: configs/default.yaml's train.batch_size, without loading the config
# the bigger model of `throughput_wide`
WIDE = ["model.hidden_size=256", "model.intermediate_size=1024", "model.num_hidden_layers=4",
        "model.num_attention_heads=4", "train.batch_size=32"]


# ----------------------------------------------------------------------------------------------------------
# timing: interleaved repetitions, medians


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_medians(contestants: dict, repeats: int, device, inner: int = 1, setups: dict | None = None) -> dict:
    """contestants: name -> fn() doing one unit of work. Each repetition times `inner` calls of every
    contestant in a fresh random order (seeded: the same orders every run), so that no contestant always runs
    right after the same other one and inherits its cache and allocator state; returns name -> per-call seconds
    of every repetition. `setups`: name -> fn() run untimed before each of that contestant's samples. The caller
    warms up first."""
    names = list(contestants)
    times = {n: [] for n in names}
    shuffle = random.Random(0).shuffle
    for _ in range(repeats):
        order = list(names)
        shuffle(order)
        for n in order:
            fn = contestants[n]
            if setups and n in setups:
                setups[n]()
            gc.collect()
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            _sync(device)
            times[n].append((time.perf_counter() - t0) / inner)
    return times


def _summary(samples: list[float]) -> dict:
    return {"median_s": statistics.median(samples), "min_s": min(samples), "max_s": max(samples),
            "repeats": len(samples)}


# ----------------------------------------------------------------------------------------------------------
# machine


def machine_info(device) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers

    info = {
        "cpu": cpu,
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "cuda_available": torch.cuda.is_available(),
        "load_average_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


# ----------------------------------------------------------------------------------------------------------
# 1. CustomLayerNorm vs torch.nn.LayerNorm


OP = "normlab::layer_norm"


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


def bench_layernorm(device, shapes, repeats: int) -> dict:
    """Per setting and shape: torch.nn.LayerNorm and CustomLayerNorm on each backend of normlab::layer_norm (the
    reference, and the fast one `train.kernels=auto` registers here), interleaved; the fast one stays registered."""
    import normlab_kernels

    def use(mode):  # untimed, before each sample: which implementation of the operator runs
        return lambda: normlab_kernels.enable(mode, device)

    training_backend = normlab_kernels.enable("auto", device)[OP]
    select = {"reference": use("reference")}
    if training_backend != "reference":
        select[training_backend] = use("auto")
    backends = list(select)
    rows = []
    for label, dtype, autocast in ln_settings(device):
        for shape in shapes:
            torch.manual_seed(0)
            x = torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)
            torch_fn, custom_fn = _ln_contestants(x, autocast, device)
            contestants = {"torch": torch_fn, **{b: custom_fn for b in backends}}
            for b, fn in contestants.items():  # warm-up (CUDA: Triton compiles the kernels here)
                if b in select:
                    select[b]()
                for _ in range(3):
                    fn()
            # calibrate: about 2 ms of the reference's work per timed sample
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(10):
                torch_fn()
            _sync(device)
            inner = max(1, min(200, int(0.002 / max((time.perf_counter() - t0) / 10, 1e-7))))
            times = interleaved_medians(contestants, repeats, device, inner, setups=select)
            t_ref = statistics.median(times["torch"])
            for b in backends:
                t = statistics.median(times[b])
                paired = statistics.median(p / q for p, q in zip(times[b], times["torch"]))
                rows.append({"setting": label, "dtype": str(dtype).replace("torch.", ""),
                             "autocast": str(autocast).replace("torch.", "") if autocast else None,
                             "shape": list(shape), "backend": b, "custom_us": t * 1e6, "torch_us": t_ref * 1e6,
                             "ratio": t / t_ref, "paired_ratio_median": paired,
                             "training_default": b == training_backend})
    normlab_kernels.enable("auto", device)
    geomean = {}
    for r in rows:
        geomean.setdefault(f"{r['setting']}/{r['backend']}/hidden {r['shape'][-1]}", []).append(r["ratio"])
    geomean = {k: math.exp(statistics.mean(math.log(v) for v in vs)) for k, vs in geomean.items()}
    return {"what": "CustomLayerNorm fwd+bwd time / torch.nn.LayerNorm fwd+bwd time (lower is better)",
            "goal": f"<= {GOALS['layernorm']}", "training_path": training_backend, "backends": backends,
            "unavailable": normlab_kernels.unavailable(device), "rows": rows, "geomean_ratio": geomean,
            "training_ratio": {label: geomean.get(f"{label}/{training_backend}/hidden {LN_WIDTHS[0]}")
                               for label, _, _ in ln_settings(device)}}


# ----------------------------------------------------------------------------------------------------------
# data: the real SST-2 batches training uses


def load_data(cfg):
    from common.data import build_dataloaders, get_tokenizer, label_names, resolve_dataset, tokenize_splits

    d = cfg["data"]
    dsd = resolve_dataset(cfg)
    tokenizer = get_tokenizer(cfg, dsd[d["train_split"]][d["text_column"]])
    tokenized = tokenize_splits(dsd, tokenizer, cfg)
    num_labels = len(label_names(dsd, cfg))
    return tokenizer, tokenized, num_labels, build_dataloaders


def _loader_for(cfg, tokenizer, tokenized, build_dataloaders, group_by_length: bool):
    c = {**cfg, "data": {**cfg["data"], "group_by_length": group_by_length}}
    train_loader, _ = build_dataloaders(c, tokenizer, tokenized)
    train_loader.batch_sampler.set_epoch(0)
    return train_loader


# ----------------------------------------------------------------------------------------------------------
# 3. padding


def bench_padding(cfg, tokenizer, tokenized, build_dataloaders) -> dict:
    """Pad fraction over one epoch (epoch 0) of each sampler, counted on the collated attention masks, i.e. on
    exactly what the model receives: 1 - real tokens / (batch rows x padded length), summed over batches."""
    from common.data import pad_fraction

    out = {"what": "padded positions / all positions over one epoch of train batches (lower is better)",
           "goal": f"<= {GOALS['padding']}", "batch_size": cfg["train"]["batch_size"], "seed": cfg["seed"],
           "epoch": 0, "examples": len(tokenized[cfg["data"]["train_split"]])}
    for name, grouped in (("random", False), ("length_grouped", True)):
        real = slots = 0
        per_batch = []
        for batch in _loader_for(cfg, tokenizer, tokenized, build_dataloaders, grouped):
            m = batch["attention_mask"]
            real += int(m.sum())
            slots += m.numel()
            per_batch.append(pad_fraction(m))
        out[name] = {"pad_fraction": 1.0 - real / slots, "mean_batch_pad_fraction": statistics.mean(per_batch),
                     "batches": len(per_batch), "real_tokens": real, "padded_slots": slots}
    out["reduction"] = out["random"]["pad_fraction"] / max(out["length_grouped"]["pad_fraction"], 1e-12)
    return out


# ----------------------------------------------------------------------------------------------------------
# 2. throughput and 4. memory: the two models


def build_models(cfg, vocab_size: int, pad_token_id: int, num_labels: int, seed: int):
    """NormLab (the default config's model) and an HF BERT of identical size; same seed for both."""
    from transformers import BertConfig, BertForSequenceClassification

    from common.config import model_config_from
    from model import NormLabForSequenceClassification

    nl_config = model_config_from(cfg, vocab_size=vocab_size, pad_token_id=pad_token_id, num_labels=num_labels)
    torch.manual_seed(seed)
    normlab = NormLabForSequenceClassification(nl_config)
    m = cfg["model"]
    hf_config = BertConfig(
        vocab_size=vocab_size, hidden_size=nl_config.hidden_size, num_hidden_layers=nl_config.num_hidden_layers,
        num_attention_heads=nl_config.num_attention_heads, intermediate_size=nl_config.intermediate_size,
        hidden_act=nl_config.hidden_act, hidden_dropout_prob=nl_config.hidden_dropout_prob,
        attention_probs_dropout_prob=nl_config.attention_probs_dropout_prob,
        max_position_embeddings=nl_config.max_position_embeddings, type_vocab_size=nl_config.type_vocab_size,
        initializer_range=nl_config.initializer_range, layer_norm_eps=nl_config.norm_eps,
        pad_token_id=pad_token_id, num_labels=num_labels, classifier_dropout=nl_config.classifier_dropout,
    )
    hf_config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    hf = BertForSequenceClassification(hf_config)
    assert m["hidden_size"] == hf.config.hidden_size
    return normlab, hf


def param_counts(normlab, hf) -> dict:
    n_nl = sum(p.numel() for p in normlab.parameters())
    n_hf = sum(p.numel() for p in hf.parameters())
    pooler = sum(p.numel() for p in hf.bert.pooler.parameters())
    hf_emb_norm = sum(p.numel() for p in hf.bert.embeddings.LayerNorm.parameters())
    nl_emb_norm = sum(p.numel() for p in normlab.normlab.embeddings.norm.parameters()) \
        if normlab.normlab.embeddings.norm is not None else 0
    final = normlab.normlab.encoder.final_norm
    nl_final = sum(p.numel() for p in final.parameters()) if final is not None else 0
    explained = n_hf - pooler - hf_emb_norm + nl_emb_norm + nl_final
    return {
        "normlab": n_nl, "hf_bert": n_hf, "difference_hf_minus_normlab": n_hf - n_nl,
        "explanation": (f"HF has BERT's pooler (dense D->D + tanh: {pooler} params) that NormLab's classifier "
                        f"omits; HF normalizes the embeddings ({hf_emb_norm}) where pre-LN NormLab has "
                        f"{'an embedding norm (' + str(nl_emb_norm) + ')' if nl_emb_norm else 'none'} and "
                        f"{'a final norm (' + str(nl_final) + ')' if nl_final else 'no final norm'}; every other "
                        f"tensor has the same shape"),
        "explained_exactly": explained == n_nl,
    }


def make_step(accelerator, model, train_cfg: dict, logged: bool = False):
    """(step(batch), optimizer): one training step as train.py's loop takes it (forward, backward, clipping, the
    non-finite check, the fused AdamW step) on a fresh AdamW with a constant rate. `logged`: also the stability
    logging of a train.py logging step (train.log_steps=1: every step), from the probe's measurements to the metrics
    row combined over processes."""
    from contextlib import nullcontext

    from transformers import get_scheduler

    from common.probes import StabilityProbe
    from model.norms import BatchStatNorm

    optimizer = adamw(model, train_cfg)
    scheduler = get_scheduler("constant", optimizer)
    probe = StabilityProbe(model, BatchStatNorm) if logged else None
    max_norm = train_cfg["max_grad_norm"]

    def step(batch):  # one micro-batch per optimizer step, as train.py with grad_accum_steps=1
        with accelerator.accumulate(model):
            with probe.forward(batch["attention_mask"]) if logged else nullcontext():
                loss = model(**model_inputs(batch)).loss
            accelerator.backward(loss)
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
            nonfinite, _ = step_flags(accelerator, loss, grad_norm, False)
            grad_norm = grad_norm.item()
            if not nonfinite:
                with probe.update(grad_norm, max_norm) if logged else nullcontext():
                    optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if logged:
            probe.count(loss, batch["attention_mask"])
            probe.collect(accelerator, grad_norm, optimizer.param_groups[0]["lr"])
        scheduler.step()
        return loss

    return step, optimizer


def take_batches(cfg, tokenizer, tokenized, build_dataloaders, n: int, device) -> list[dict]:
    loader = _loader_for(cfg, tokenizer, tokenized, build_dataloaders, cfg["data"]["group_by_length"])
    batches = []
    for batch in loader:
        batches.append({k: v.to(device) for k, v in batch.items() if k in MODEL_INPUTS})
        if len(batches) == n:
            break
    return batches


def on_reference_kernels(step, device):
    """The step with NormLab's operators on their reference implementation (re-registered around each step)."""
    import normlab_kernels

    def wrapped(batch):
        normlab_kernels.enable("reference", device)
        try:
            return step(batch)
        finally:
            normlab_kernels.enable("auto", device)

    return wrapped


def contestant_models(cfg, vocab_size, pad_token_id, num_labels, compile_normlab: bool, compile_hf: bool,
                      diagnose: bool, extras: bool) -> dict:
    """name -> model, all built from the same seed. `extras` False: only NormLab eager and HF BERT eager."""
    seed = cfg["seed"]

    def build(c=cfg):
        return build_models(c, vocab_size, pad_token_id, num_labels, seed)

    normlab, hf = build()
    models = {"normlab_eager": normlab, "hf_bert_eager": hf}
    if not extras:
        return models
    models["normlab_eager_logged"] = build()[0]  # with train.py's per-step stability logging: what it costs
    if compile_normlab:
        models["normlab_compiled"] = build()[0]
        models["normlab_compiled"].compile()  # as train.py does for train.compile=true
    if diagnose:
        # the same NormLab with torch.nn.LayerNorm: what CustomLayerNorm costs inside the model
        models["normlab_eager_torch_ln"] = build({**cfg, "model": {**cfg["model"], "norm": "layernorm"}})[0]
        models["normlab_eager_padded_layout"] = build()[0]  # without skipping pad positions
        models["normlab_eager_padded_layout"].normlab.unpad = False
        # and on the reference implementation of its operators (train.kernels=reference)
        models["normlab_eager_reference_kernels"] = build()[0]
    if compile_hf:
        models["hf_bert_compiled"] = build()[1]
        models["hf_bert_compiled"].compile()
    return models


def time_interleaved_steps(steps: dict, batches, repeats: int, device) -> tuple[dict, dict, dict]:
    """Warm up every step function on every batch shape (compiles happen here), then time them interleaved at the
    finest grain, one optimizer step: for every batch each contestant takes its step in turn (order rotating), so
    a burst of load from another process lands on all of them. -> (seconds of one pass over all batches per
    repetition, per-step HF time / contestant time, warm-up seconds), each by name."""
    warmup_s = {}
    for name, step in steps.items():
        t0 = time.perf_counter()
        for b in batches:
            step(b)
        _sync(device)
        warmup_s[name] = time.perf_counter() - t0
    names = list(steps)
    per_rep = {n: [] for n in names}
    paired = {n: [] for n in names if n != "hf_bert_eager"}
    k = 0
    for _ in range(repeats):
        rep = {n: 0.0 for n in names}
        for b in batches:
            order = names[k % len(names):] + names[: k % len(names)]
            k += 1
            dt = {}
            for n in order:
                _sync(device)
                t0 = time.perf_counter()
                steps[n](b)
                _sync(device)
                dt[n] = time.perf_counter() - t0
                rep[n] += dt[n]
            for n in paired:
                paired[n].append(dt["hf_bert_eager"] / dt[n])
        for n in names:
            per_rep[n].append(rep[n])
    return per_rep, paired, warmup_s


def bench_throughput(accelerator, cfg, batches, vocab_size, pad_token_id, num_labels, device, repeats: int,
                     compile_normlab: bool, compile_hf: bool, diagnose: bool = False,
                     extras: bool = True) -> tuple[dict, dict]:
    """`extras` False: only NormLab eager and HF BERT eager (no logging, compiled or diagnostic contestants)."""
    import normlab_kernels

    compile_normlab, compile_hf, diagnose = (compile_normlab, compile_hf, diagnose) if extras else (False,) * 3
    models = contestant_models(cfg, vocab_size, pad_token_id, num_labels, compile_normlab, compile_hf, diagnose,
                               extras)
    normlab, hf = models["normlab_eager"], models["hf_bert_eager"]
    steps = {}
    for name, model in models.items():
        model.to(device).train()
        if name.startswith("normlab"):  # train.py's dropout and attention: train.kernels=auto's, or reference's
            reference = name.endswith("reference_kernels")
            normlab_kernels.apply(model, {} if reference else normlab_kernels.backends(device))
        steps[name], _ = make_step(accelerator, model, cfg["train"], logged=name == "normlab_eager_logged")
        if name == "normlab_eager_reference_kernels":
            steps[name] = on_reference_kernels(steps[name], device)
    per_rep, paired, warmup_s = time_interleaved_steps(steps, batches, repeats, device)

    real_tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    slots = sum(b["attention_mask"].numel() for b in batches)
    contestants = {}
    for name, samples in per_rep.items():
        s = _summary(samples)
        contestants[name] = {"real_tokens_per_s": real_tokens / s["median_s"],
                             "step_ms_median": s["median_s"] / len(batches) * 1e3,
                             "step_ms_min": s["min_s"] / len(batches) * 1e3,
                             "step_ms_max": s["max_s"] / len(batches) * 1e3,
                             "warmup_s": warmup_s[name]}
    hf_tps = contestants["hf_bert_eager"]["real_tokens_per_s"]
    ratios = {f"{n}_over_hf_bert_eager": c["real_tokens_per_s"] / hf_tps for n, c in contestants.items()
              if n not in ("hf_bert_eager", "normlab_eager_logged")}
    if compile_hf and compile_normlab:
        ratios["normlab_compiled_over_hf_bert_compiled"] = (contestants["normlab_compiled"]["real_tokens_per_s"]
                                                           / contestants["hf_bert_compiled"]["real_tokens_per_s"])
    logging_overhead = (contestants["normlab_eager_logged"]["step_ms_median"]
                        / contestants["normlab_eager"]["step_ms_median"] - 1) if extras else None
    return {
        "what": "real (non-pad) training tokens per second, full step: forward, backward, clip, AdamW (higher is better)",
        "goal": f">= {GOALS['throughput']} (NormLab over HF BERT)",
        "batches": len(batches), "batch_size": cfg["train"]["batch_size"],
        "padded_lengths": [int(b["input_ids"].shape[1]) for b in batches],
        "real_tokens_per_pass": real_tokens, "pad_fraction_of_these_batches": 1 - real_tokens / slots,
        "same_padded_batches_for_all": True, "repeats": repeats, "normlab_skips_padding": normlab.normlab.unpad,
        "model": {k: cfg["model"][k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                               "intermediate_size")},
        "kernels": normlab_kernels.backends(device),  # what NormLab's operators ran on (train.kernels=auto)
        "compiled": "normlab_compiled" in models,
        "compile_note": None if compile_normlab else ("not run (--no-compile, default with --quick)" if extras
                                                      else "not run at this width"),
        "contestants": contestants, "ratios": ratios,
        "logging_overhead": logging_overhead,  # step time with stability logging every step / without, minus 1
        # robustness check: median over steps of the per-step ratio
        "paired_step_ratio_median": {f"{n}_over_hf_bert_eager": statistics.median(v) for n, v in paired.items()
                                     if n != "normlab_eager_logged"},
        "params": param_counts(normlab, hf),
    }, {"normlab": normlab, "hf_bert": hf}


def _step_peak_cpu(step, batch) -> int:
    """Peak bytes held by torch's CPU allocator during one step, above what was live when it started.

    torch.profiler(profile_memory=True) records every op's allocations and frees; summing them in op start
    order gives the live-bytes curve of the step, whose maximum is the peak (activations, gradients, temporaries,
    optimizer scratch). It counts tensor bytes, not allocator slack or the Python heap, and so is identical
    from run to run and independent of what else ran in the process."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(batch)
    cur = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        cur += e.self_cpu_memory_usage
        peak = max(peak, cur)
    return peak


def bench_memory(accelerator, cfg, models: dict, batch: dict, device) -> dict:
    """Peak memory of one training step on the longest of the timed batches (the same batch for both). Measured
    on the second step (the first creates the AdamW state); `resident_bytes` = parameters + AdamW state,
    `step_peak_bytes` = the step's peak above that, `total_peak_bytes` = their sum."""
    t = cfg["train"]
    if device.type == "cuda":
        method = ("torch.cuda.max_memory_allocated during the 2nd step minus torch.cuda.memory_allocated at its "
                  "start (tensor bytes on the GPU)")
    else:
        method = ("torch.profiler(profile_memory=True): running sum of every op's CPU allocations minus frees during "
                  "the 2nd step, maximum above the bytes live at its start (exact tensor bytes; excludes "
                  "allocator slack and the Python heap)")
    out = {"what": "peak memory of one training step (lower is better)", "method": method,
           "batch_shape": list(batch["input_ids"].shape)}
    for name, model in models.items():
        model.to(device).train()
        step, opt = make_step(accelerator, model, t)
        step(batch)  # creates the AdamW state
        resident = sum(p.numel() * p.element_size() for p in model.parameters())
        resident += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                        if isinstance(v, torch.Tensor))
        if device.type == "cuda":
            _sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            start = torch.cuda.memory_allocated(device)
            step(batch)
            _sync(device)
            peak = torch.cuda.max_memory_allocated(device) - start
        else:
            peak = _step_peak_cpu(step, batch)
        out[name] = {"resident_bytes": resident, "step_peak_bytes": peak, "total_peak_bytes": resident + peak}
    out["ratio_total_normlab_over_hf"] = out["normlab"]["total_peak_bytes"] / out["hf_bert"]["total_peak_bytes"]
    out["ratio_step_normlab_over_hf"] = out["normlab"]["step_peak_bytes"] / out["hf_bert"]["step_peak_bytes"]
    return out


# ----------------------------------------------------------------------------------------------------------
# output


def _goal_mark(ok: bool) -> str:
    return "meets goal" if ok else "MISSES goal"


def _print_throughput(title: str, tp: dict) -> None:
    m = tp["model"]
    print(f"\n{title} Training throughput, real tokens/s (hidden {m['hidden_size']}, {m['num_hidden_layers']} layers, "
          f"{m['num_attention_heads']} heads; {tp['batches']} SST-2 length-grouped batches of "
          f"{tp['batch_size']}, padded lengths {tp['padded_lengths']}, pad {tp['pad_fraction_of_these_batches']:.1%}; "
          f"same padded batches for every model; {tp['repeats']} interleaved repeats; NormLab's kernels "
          f"{sorted(set(tp['kernels'].values()))}; goal {tp['goal']})")
    print(f"   {'model':<33}{'tokens/s':>10}{'ms/step med':>13}{'min':>8}{'max':>8}{'warm-up s':>11}")
    for n, c in tp["contestants"].items():
        print(f"   {n:<33}{c['real_tokens_per_s']:>10.0f}{c['step_ms_median']:>13.1f}{c['step_ms_min']:>8.1f}"
              f"{c['step_ms_max']:>8.1f}{c['warmup_s']:>11.1f}")
    for k, v in tp["ratios"].items():
        extra = tp["paired_step_ratio_median"].get(k)
        extra = f" (median of per-step ratios {extra:.2f}x)" if extra is not None else ""
        print(f"   {k}: {v:.2f}x{extra}  -> {_goal_mark(v >= GOALS['throughput'])}")
    if tp["logging_overhead"] is not None:
        print(f"   stability logging every step (normlab_eager_logged vs normlab_eager): "
              f"{tp['logging_overhead']:+.1%} step time  -> {_goal_mark(tp['logging_overhead'] <= GOALS['logging'])} "
              f"(goal <= {GOALS['logging']:.0%})")
    if tp["normlab_skips_padding"]:
        print("   note: NormLab packs the real tokens internally (unpad) and so skips pad positions; both models "
              "receive the identical padded batches, and tokens/s counts real tokens only")
    if tp["compile_note"]:
        print(f"   compiled NormLab: {tp['compile_note']}")
    p = tp["params"]
    print(f"   parameters: NormLab {p['normlab']:,}, HF BERT {p['hf_bert']:,} (difference {p['difference_hf_minus_normlab']:,}"
          f"{', fully explained' if p['explained_exactly'] else ', NOT fully explained'}): {p['explanation']}")


def print_report(res: dict) -> None:
    m = res["machine"]
    print(f"NormLab bench  ({'QUICK: tiny sizes, numbers not meaningful' if res['settings']['quick'] else 'full'})")
    print(f"machine: {m['cpu']}, {m['cpu_cores']} cores ({m['torch_threads']} torch threads), torch {m['torch']}, "
          f"transformers {m['transformers']}, device {m['device']}" + (f" ({m['gpu']})" if m.get("gpu") else ""))
    print(f"load average at start / end: {m['load_average_start']} / {m.get('load_average_end')}  "
          f"(other processes inflate and scatter timings; ratios are interleaved medians)")
    print(f"command: {res['settings']['command']}")

    ln = res["layernorm"]
    print(f"\n1. CustomLayerNorm (normlab::layer_norm) fwd+bwd / torch.nn.LayerNorm  (training backend: "
          f"'{ln['training_path']}', train.kernels=auto; goal {ln['goal']}; * = training backend)")
    if ln["unavailable"]:
        print(f"   the fast backend is unavailable here: {ln['unavailable']}")
    print(f"   {'setting':<26}{'shape':<16}{'backend':<11}{'custom us':>10}{'torch us':>10}{'ratio':>8}{'paired':>8}")
    for r in ln["rows"]:
        star = " *" if r["training_default"] else ""
        print(f"   {r['setting']:<26}{'x'.join(map(str, r['shape'])):<16}{r['backend']:<11}"
              f"{r['custom_us']:>10.1f}{r['torch_us']:>10.1f}{r['ratio']:>7.2f}x{r['paired_ratio_median']:>7.2f}x{star}")
    for label, v in ln["training_ratio"].items():
        print(f"   {label} geometric mean, training backend, default width: {v:.2f}x  -> "
              f"{_goal_mark(v <= GOALS['layernorm'])}")
    for k, v in ln["geomean_ratio"].items():
        print(f"   geometric mean {k}: {v:.2f}x")
    print("   (ratio = median custom / median torch; paired = median over repetitions of the per-repetition ratio)")
    print(f"   {res['cuda_note']}")

    if "throughput" not in res:  # --layernorm-only
        print(f"\ntotal bench time {res['settings']['wall_s']:.0f} s (section 1 only)")
        return
    _print_throughput("2.", res["throughput"])
    _print_throughput("2b. Bigger width:", res["throughput_wide"])

    pd = res["padding"]
    print(f"\n3. Pad fraction, SST-2 train ({pd['examples']:,} rows), batch {pd['batch_size']}, epoch 0 "
          f"(goal {pd['goal']} for length-grouped)")
    for n in ("random", "length_grouped"):
        v = pd[n]
        print(f"   {n:<16}{v['pad_fraction']:>8.2%}  (mean per batch {v['mean_batch_pad_fraction']:.2%}, "
              f"{v['batches']} batches)")
    lg = pd["length_grouped"]["pad_fraction"]
    print(f"   length-grouped -> {_goal_mark(lg <= GOALS['padding'])}; {pd['reduction']:.0f}x less padding than random")

    mem = res["memory"]
    mib = 2 ** 20
    print(f"\n4. Peak memory of one training step, batch {'x'.join(map(str, mem['batch_shape']))}")
    print(f"   method: {mem['method']}")
    for n in ("normlab", "hf_bert"):
        v = mem[n]
        print(f"   {n:<9} params+AdamW {v['resident_bytes'] / mib:7.1f} MiB, step peak {v['step_peak_bytes'] / mib:7.1f} MiB, "
              f"total {v['total_peak_bytes'] / mib:7.1f} MiB")
    print(f"   NormLab / HF: total {mem['ratio_total_normlab_over_hf']:.2f}x, step peak {mem['ratio_step_normlab_over_hf']:.2f}x")
    secs = ", ".join(f"{k} {v:.0f}" for k, v in res["settings"]["section_s"].items())
    print(f"\ntotal bench time {res['settings']['wall_s']:.0f} s ({secs})")


# ----------------------------------------------------------------------------------------------------------
# main


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    ap.add_argument("--quick", action="store_true", help="tiny sizes and few repeats (tests); numbers not meaningful")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repetitions of the throughput pass (default 9; quick 3); LayerNorm gets 5x as many")
    ap.add_argument("--batches", type=int, default=None, help="SST-2 batches per throughput repetition (default 12; quick 2)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--compile", dest="compile", action="store_true", default=None,
                    help="also time the compiled NormLab (default on, off with --quick)")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--compile-hf", action="store_true", help="also time a compiled HF BERT (slow to compile)")
    ap.add_argument("--diagnose", action="store_true",
                    help="also time NormLab with torch's LayerNorm, and with its padded layout (unpad=False)")
    ap.add_argument("--layernorm-only", action="store_true",
                    help="section 1 only (no data, no models): e.g. the Triton kernel on a GPU machine")
    ap.add_argument("--out", default=None, help="also write the JSON object to this file")
    ap.add_argument("--config", default=None, help="a config variant (default: configs/default.yaml)")
    args = ap.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        ap.error(f"--repeats={args.repeats} must be >= 1")
    if args.batches is not None and args.batches < 1:
        ap.error(f"--batches={args.batches} must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    wall0 = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench.py: --device cuda but torch.cuda.is_available() is False; use --device cpu", file=sys.stderr)
        return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    quick = args.quick
    repeats = args.repeats or (3 if quick else 9)
    n_batches = args.batches or (2 if quick else 12)
    do_compile = (not quick) if args.compile is None else args.compile

    import normlab_kernels

    kernels = normlab_kernels.enable("auto", device)  # as train.py does (train.kernels=auto)
    overrides = [f"data.max_train_samples={QUICK_TRAIN_SAMPLES}"] if quick else []
    cfg = {"train": {"batch_size": LN_ONLY_BATCH}}  # --layernorm-only: no config library (the GPU image has none)
    if not args.layernorm_only:
        from common.config import load_config
        cfg = load_config(args.config, overrides)

    # the training steps in the precision training uses on this device (configs/accelerate: bf16 on GPUs)
    autocast = "bf16" if device.type == "cuda" else None
    res = {"machine": machine_info(device),
           "settings": {"quick": quick, "repeats": repeats, "batches": n_batches, "compile": do_compile,
                        "autocast": autocast, "compile_hf": args.compile_hf, "config": args.config, "config_overrides": overrides,
                        "command": "python scripts/bench.py " + " ".join(sys.argv[1:] if argv is None else argv)},
           "kernels": kernels}

    # 1. LayerNorm at training shapes
    section_s = res["settings"]["section_s"] = {}
    t0 = time.perf_counter()
    # LayerNorm samples are short (calibrated to a couple of ms of work each): many more of them than of training
    # passes, for stable medians
    res["layernorm"] = bench_layernorm(device, ln_shapes(device, quick, cfg["train"]["batch_size"]), 5 * repeats)
    res["cuda_note"] = ("CUDA paths measured on " + res["machine"].get("gpu", "GPU") if device.type == "cuda" else
                        "CUDA paths (fp32/bf16 LayerNorm, GPU throughput and memory): untested, no GPU in this run")
    section_s["layernorm"] = time.perf_counter() - t0
    if not args.layernorm_only:
        run_model_sections(args, res, cfg, overrides, device, repeats, n_batches, do_compile)
    return finish(args, res, wall0)


def training_precision(device):
    """The precision training uses on this device (configs/accelerate: bf16 autocast on GPUs, float32 on CPU)."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def run_model_sections(args, res, cfg, overrides, device, repeats, n_batches, do_compile) -> None:
    """Sections 2-4 (they need the data and both models)."""
    from accelerate import Accelerator

    from common.config import load_config

    accelerator = Accelerator(cpu=device.type == "cpu")  # one process: what make_step steps with

    section_s = res["settings"]["section_s"]

    # 3. padding (needs the data; cheap next to the timings)
    t0 = time.perf_counter()
    tokenizer, tokenized, num_labels, build_dataloaders = load_data(cfg)
    section_s["data"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    res["padding"] = bench_padding(cfg, tokenizer, tokenized, build_dataloaders)
    section_s["padding"] = time.perf_counter() - t0

    # 2. throughput on the first batches of the training loader
    t0 = time.perf_counter()
    batches = take_batches(cfg, tokenizer, tokenized, build_dataloaders, n_batches, device)
    with training_precision(device):
        res["throughput"], models = bench_throughput(
            accelerator, cfg, batches, len(tokenizer), tokenizer.pad_token_id, num_labels, device, repeats, do_compile,
            args.compile_hf, args.diagnose)

    section_s["throughput"] = time.perf_counter() - t0

    # 2b. throughput at the bigger width (same data, tokenizer and batches; NormLab eager vs HF BERT eager)
    t0 = time.perf_counter()
    cfg_wide = load_config(args.config, overrides + WIDE)
    with training_precision(device):
        res["throughput_wide"], _ = bench_throughput(
            accelerator, cfg_wide, take_batches(cfg_wide, tokenizer, tokenized, build_dataloaders, n_batches, device),
            len(tokenizer), tokenizer.pad_token_id, num_labels, device, repeats, False, False, extras=False)
    section_s["throughput_wide"] = time.perf_counter() - t0

    # 4. memory, on the longest timed batch
    t0 = time.perf_counter()
    longest = max(batches, key=lambda b: b["input_ids"].numel())
    with training_precision(device):
        res["memory"] = bench_memory(accelerator, cfg, models, longest, device)
    section_s["memory"] = time.perf_counter() - t0


def finish(args, res, wall0) -> int:
    res["machine"]["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    res["settings"]["wall_s"] = time.perf_counter() - wall0
    if args.out:
        atomic_write_json(args.out, res, indent=1)
    if args.json:
        print(json.dumps(res))
    else:
        print_report(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
