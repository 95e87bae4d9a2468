"""Section 2: training throughput in real (non-pad) tokens/s of NormLab over HF BERT of the same size, full
training steps on the same padded batches, timed step by step in rotating order."""

import statistics
import time

from normlab.bench.models import make_step, on_reference_kernels, param_counts, prepare
from normlab.bench.timer import summary, sync, timed

GOAL = 1.3  # NormLab's tokens/s over HF BERT's, at least
LOGGING_GOAL = 0.10  # step-time cost of stability logging every step, at most
BASELINE = "hf_bert_eager"  # every ratio is over this contestant
# the bigger model of `throughput_wide`
WIDE = ["model.hidden_size=256", "model.intermediate_size=1024", "model.num_hidden_layers=4",
        "model.num_attention_heads=4", "train.batch_size=32"]


def _warm_up(steps: dict, batches, device) -> dict:
    """Every step function once on every batch shape (compiles happen here); name -> seconds it took."""
    warmup_s = {}
    for name, step in steps.items():
        t0 = time.perf_counter()
        for b in batches:
            step(b)
        sync(device)
        warmup_s[name] = time.perf_counter() - t0
    return warmup_s


def time_interleaved_steps(steps: dict, batches, repeats: int, device) -> tuple[dict, dict, dict]:
    """Warm up every step function on every batch shape, then time them interleaved at the finest grain, one
    optimizer step: for every batch each contestant takes its step in turn (order rotating), so a burst of load
    from another process lands on all of them. -> (seconds of one pass over all batches per repetition, per-step
    baseline time / contestant time, warm-up seconds), each by name."""
    warmup_s = _warm_up(steps, batches, device)
    names = list(steps)
    per_rep = {n: [] for n in names}
    paired = {n: [] for n in names if n != BASELINE}
    k = 0
    for _ in range(repeats):
        rep = {n: 0.0 for n in names}
        for b in batches:
            order = names[k % len(names):] + names[: k % len(names)]
            k += 1
            dt = {n: timed(lambda: steps[n](b), device) for n in order}
            for n in order:
                rep[n] += dt[n]
            for n in paired:
                paired[n].append(dt[BASELINE] / dt[n])
        for n in names:
            per_rep[n].append(rep[n])
    return per_rep, paired, warmup_s


def _contestant_figures(per_rep: dict, warmup_s: dict, batches, real_tokens: int) -> dict:
    """name -> tokens/s of the median pass, and the median, fastest and slowest step."""
    contestants = {}
    for name, samples in per_rep.items():
        s = summary(samples)
        contestants[name] = {"real_tokens_per_s": real_tokens / s["median_s"],
                             "step_ms_median": s["median_s"] / len(batches) * 1e3,
                             "step_ms_min": s["min_s"] / len(batches) * 1e3,
                             "step_ms_max": s["max_s"] / len(batches) * 1e3,
                             "warmup_s": warmup_s[name]}
    return contestants


def _ratios(contestants: dict) -> dict:
    """Tokens/s of every NormLab contestant over the baseline's, and compiled over compiled when both ran."""
    hf_tps = contestants[BASELINE]["real_tokens_per_s"]
    ratios = {f"{n}_over_{BASELINE}": c["real_tokens_per_s"] / hf_tps for n, c in contestants.items()
              if n not in (BASELINE, "normlab_eager_logged")}
    if "normlab_compiled" in contestants and "hf_bert_compiled" in contestants:
        ratios["normlab_compiled_over_hf_bert_compiled"] = (contestants["normlab_compiled"]["real_tokens_per_s"]
                                                           / contestants["hf_bert_compiled"]["real_tokens_per_s"])
    return ratios


def bench_throughput(models: dict, batches, *, accelerator, cfg, device, repeats: int) -> dict:
    """Times the contestants of models.contestant_models(cfg, ...) on `batches`. Which ran decides what is
    reported: without `normlab_eager_logged` (extras off) no logging overhead, and no compiled run at this width."""
    import normlab.kernels

    steps = {}
    for name, model in models.items():
        prepare(name, model, device)
        steps[name], _ = make_step(accelerator, model, cfg.train, logged=name == "normlab_eager_logged")
        if name == "normlab_eager_reference_kernels":
            steps[name] = on_reference_kernels(steps[name], device)
    per_rep, paired, warmup_s = time_interleaved_steps(steps, batches, repeats, device)

    real_tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    slots = sum(b["attention_mask"].numel() for b in batches)
    contestants = _contestant_figures(per_rep, warmup_s, batches, real_tokens)
    extras = "normlab_eager_logged" in models
    logging_overhead = (contestants["normlab_eager_logged"]["step_ms_median"]
                        / contestants["normlab_eager"]["step_ms_median"] - 1) if extras else None
    return {
        "what": "real (non-pad) training tokens per second, full step: forward, backward, clip, AdamW "
                "(higher is better)",
        "goal": f">= {GOAL} (NormLab over HF BERT)",
        "batches": len(batches), "batch_size": cfg.train.batch_size,
        "padded_lengths": [int(b["input_ids"].shape[1]) for b in batches],
        "real_tokens_per_pass": real_tokens, "pad_fraction_of_these_batches": 1 - real_tokens / slots,
        "same_padded_batches_for_all": True, "repeats": repeats,
        "normlab_skips_padding": models["normlab_eager"].normlab.unpad,
        "model": {k: cfg.model.given()[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                               "intermediate_size")},
        "kernels": normlab.kernels.backends(device),  # what NormLab's operators ran on (train.kernels=auto)
        "compiled": "normlab_compiled" in models,
        "compile_note": None if "normlab_compiled" in models else (
            "not run (--no-compile, default with --quick)" if extras else "not run at this width"),
        "contestants": contestants, "ratios": _ratios(contestants),
        "logging_overhead": logging_overhead,  # step time with stability logging every step / without, minus 1
        # robustness check: median over steps of the per-step ratio
        "paired_step_ratio_median": {f"{n}_over_{BASELINE}": statistics.median(v) for n, v in paired.items()
                                     if n != "normlab_eager_logged"},
        "params": param_counts(models["normlab_eager"], models[BASELINE]),
    }
