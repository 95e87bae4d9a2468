"""scripts/bench.py's printed report: one block per section, each figure with its goal."""

from normlab.bench import layernorm, padding, throughput

MIB = 2 ** 20


def _goal_mark(ok: bool) -> str:
    return "meets goal" if ok else "MISSES goal"


def _print_header(res: dict) -> None:
    m = res["machine"]
    print(f"NormLab bench  ({'QUICK: tiny sizes, numbers not meaningful' if res['settings']['quick'] else 'full'})")
    print(f"machine: {m['cpu']}, {m['cpu_cores']} cores ({m['torch_threads']} torch threads), torch {m['torch']}, "
          f"transformers {m['transformers']}, device {m['device']}" + (f" ({m['gpu']})" if m.get("gpu") else ""))
    print(f"load average at start / end: {m['load_average_start']} / {m.get('load_average_end')}  "
          f"(other processes inflate and scatter timings; ratios are interleaved medians)")
    print(f"command: {res['settings']['command']}")


def _print_layernorm(ln: dict, cuda_note: str) -> None:
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
              f"{_goal_mark(v <= layernorm.GOAL)}")
    for k, v in ln["geomean_ratio"].items():
        print(f"   geometric mean {k}: {v:.2f}x")
    print("   (ratio = median custom / median torch; paired = median over repetitions of the per-repetition ratio)")
    print(f"   {cuda_note}")


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
        print(f"   {k}: {v:.2f}x{extra}  -> {_goal_mark(v >= throughput.GOAL)}")
    if tp["logging_overhead"] is not None:
        goal = throughput.LOGGING_GOAL
        print(f"   stability logging every step (normlab_eager_logged vs normlab_eager): "
              f"{tp['logging_overhead']:+.1%} step time  -> {_goal_mark(tp['logging_overhead'] <= goal)} "
              f"(goal <= {goal:.0%})")
    if tp["normlab_skips_padding"]:
        print("   note: NormLab packs the real tokens internally (unpad) and so skips pad positions; both models "
              "receive the identical padded batches, and tokens/s counts real tokens only")
    if tp["compile_note"]:
        print(f"   compiled NormLab: {tp['compile_note']}")
    p = tp["params"]
    print(f"   parameters: NormLab {p['normlab']:,}, HF BERT {p['hf_bert']:,} "
          f"(difference {p['difference_hf_minus_normlab']:,}"
          f"{', fully explained' if p['explained_exactly'] else ', NOT fully explained'}): {p['explanation']}")


def _print_padding(pd: dict) -> None:
    print(f"\n3. Pad fraction, SST-2 train ({pd['examples']:,} rows), batch {pd['batch_size']}, epoch 0 "
          f"(goal {pd['goal']} for length-grouped)")
    for n in ("random", "length_grouped"):
        v = pd[n]
        print(f"   {n:<16}{v['pad_fraction']:>8.2%}  (mean per batch {v['mean_batch_pad_fraction']:.2%}, "
              f"{v['batches']} batches)")
    lg = pd["length_grouped"]["pad_fraction"]
    print(f"   length-grouped -> {_goal_mark(lg <= padding.GOAL)}; {pd['reduction']:.0f}x less padding than random")


def _print_memory(mem: dict) -> None:
    print(f"\n4. Peak memory of one training step, batch {'x'.join(map(str, mem['batch_shape']))}")
    print(f"   method: {mem['method']}")
    for n in ("normlab", "hf_bert"):
        v = mem[n]
        print(f"   {n:<9} params+AdamW {v['resident_bytes'] / MIB:7.1f} MiB, "
              f"step peak {v['step_peak_bytes'] / MIB:7.1f} MiB, "
              f"total {v['total_peak_bytes'] / MIB:7.1f} MiB")
    print(f"   NormLab / HF: total {mem['ratio_total_normlab_over_hf']:.2f}x, "
          f"step peak {mem['ratio_step_normlab_over_hf']:.2f}x")


def print_report(res: dict) -> None:
    """The whole report; with --layernorm-only (no "throughput" in `res`) section 1 alone."""
    _print_header(res)
    _print_layernorm(res["layernorm"], res["cuda_note"])
    if "throughput" not in res:  # --layernorm-only
        print(f"\ntotal bench time {res['settings']['wall_s']:.0f} s (section 1 only)")
        return
    _print_throughput("2.", res["throughput"])
    _print_throughput("2b. Bigger width:", res["throughput_wide"])
    _print_padding(res["padding"])
    _print_memory(res["memory"])
    secs = ", ".join(f"{k} {v:.0f}" for k, v in res["settings"]["section_s"].items())
    print(f"\ntotal bench time {res['settings']['wall_s']:.0f} s ({secs})")
