"""scripts/bench.py --quick --json: every section present with finite positive numbers, and its pad fractions equal
a direct count on the same batches (rebuilt here from the samplers and the token lengths). No timed assertions:
the timings of a quick run on a shared machine mean nothing, only their presence and sanity are checked."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # the benchmark script, run for real

REPO = Path(__file__).resolve().parent.parent


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def bench_json():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
           "TOKENIZERS_PARALLELISM": "false"}
    # one torch thread: on a shared 2-core machine a second OpenMP thread only waits for the other
    proc = subprocess.run([sys.executable, "scripts/bench.py", "--quick", "--json", "--threads", "1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"--json must print exactly one JSON line, got:\n{proc.stdout[-2000:]}"
    return json.loads(lines[0])


def test_every_section_present_and_positive(bench_json):
    res = bench_json
    for section in ("machine", "settings", "kernels", "layernorm", "throughput", "throughput_wide", "padding", "memory",
                    "cuda_note"):
        assert section in res, section
    m = res["machine"]
    assert m["cpu"] and m["torch"]
    assert m["device"] == "cpu" or m["device"].startswith("cuda")
    assert _positive(m["cpu_cores"]) and _positive(m["torch_threads"])
    assert res["settings"]["quick"] is True

    ln = res["layernorm"]
    assert ln["rows"], "no LayerNorm measurement"
    # the backend training uses (train.kernels=auto: "cpp" unless it cannot be built here) and the reference
    assert ln["training_path"] == res["kernels"]["normlab::layer_norm"] in ("cpp", "reference")
    assert {r["backend"] for r in ln["rows"]} == {"reference", ln["training_path"]}
    assert {r["shape"][-1] for r in ln["rows"]} == {128, 256}  # the default width and the bigger one
    for r in ln["rows"]:
        assert _positive(r["custom_us"]) and _positive(r["torch_us"]) and _positive(r["ratio"]), r
        assert r["ratio"] == pytest.approx(r["custom_us"] / r["torch_us"])
        assert r["training_default"] == (r["backend"] == ln["training_path"])
    assert all(_positive(v) for v in ln["training_ratio"].values()) and "float32" in ln["training_ratio"]

    tp = res["throughput"]
    for name in ("normlab_eager", "hf_bert_eager", "normlab_eager_logged"):
        c = tp["contestants"][name]
        assert _positive(c["real_tokens_per_s"]) and _positive(c["step_ms_median"]), name
    assert _positive(tp["ratios"]["normlab_eager_over_hf_bert_eager"])
    runs = tp["contestants"]
    assert tp["ratios"]["normlab_eager_over_hf_bert_eager"] == pytest.approx(
        runs["normlab_eager"]["real_tokens_per_s"] / runs["hf_bert_eager"]["real_tokens_per_s"])
    assert tp["logging_overhead"] == pytest.approx(
        runs["normlab_eager_logged"]["step_ms_median"] / runs["normlab_eager"]["step_ms_median"] - 1)
    p = tp["params"]
    assert _positive(p["normlab"]) and _positive(p["hf_bert"])
    assert p["explained_exactly"], p  # the sizes differ only by what the explanation names (the pooler, ...)
    assert tp["kernels"] == res["kernels"]

    wide = res["throughput_wide"]  # the bigger width: hidden 256, 4 layers, 4 heads, batch 32
    assert wide["model"] == {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                             "intermediate_size": 1024} and wide["batch_size"] == 32
    assert set(wide["contestants"]) == {"normlab_eager", "hf_bert_eager"}
    assert _positive(wide["ratios"]["normlab_eager_over_hf_bert_eager"]) and wide["logging_overhead"] is None
    assert wide["params"]["explained_exactly"] and wide["params"]["normlab"] > 2 * p["normlab"]

    mem = res["memory"]
    assert mem["method"]
    for name in ("normlab", "hf_bert"):
        for key in ("resident_bytes", "step_peak_bytes", "total_peak_bytes"):
            assert _positive(mem[name][key]), (name, key)
    assert _positive(mem["ratio_total_normlab_over_hf"]) and _positive(mem["ratio_step_normlab_over_hf"])


def _direct_pad_fraction(batches, lengths):
    """Padded to the longest member of each batch (what the collator does): 1 - real / (rows x max length)."""
    real = sum(int(lengths[b].sum()) for b in batches)
    slots = sum(int(lengths[b].max()) * len(b) for b in batches)
    return 1.0 - real / slots, len(batches), real, slots


def test_pad_fractions_match_a_direct_count(bench_json):
    from normlab.config.loader import load_config
    from normlab.data.batching import LengthGroupedBatchSampler, RandomBatchSampler
    from normlab.data.sources import resolve_dataset
    from normlab.data.tokenizer import get_tokenizer, tokenize_splits

    res = bench_json
    pad = res["padding"]
    cfg = load_config(res["settings"]["config"], res["settings"]["config_overrides"])
    d = cfg.data
    dsd = resolve_dataset(d, with_labels=True)
    tokenizer = get_tokenizer(d, cfg.model.vocab_size, dsd[d.train_split][d.text_column])
    lengths = np.asarray(tokenize_splits(dsd, tokenizer, d, cfg.task)[d.train_split]["length"])
    assert pad["examples"] == len(lengths)
    bs, seed = cfg.train.batch_size, cfg.seed
    assert (pad["batch_size"], pad["seed"]) == (bs, seed)

    samplers = {"random": RandomBatchSampler(len(lengths), bs, seed=seed),
                "length_grouped": LengthGroupedBatchSampler(lengths, bs, seed=seed)}
    for name, sampler in samplers.items():
        sampler.set_epoch(pad["epoch"])
        frac, n, real, slots = _direct_pad_fraction([np.asarray(b) for b in sampler], lengths)
        got = pad[name]
        assert (got["batches"], got["real_tokens"], got["padded_slots"]) == (n, real, slots), name
        assert got["pad_fraction"] == pytest.approx(frac, abs=1e-12), name
        assert 0 < got["pad_fraction"] < 1
    # random batches are far more padded than length-grouped ones (SST-2: ~67% vs a few %)
    assert pad["random"]["pad_fraction"] > 5 * pad["length_grouped"]["pad_fraction"]


def test_shared_cpu_bench_runs_alone_then_two_together_and_prints_each_ratio(tmp_path):
    """scripts/bench_shared_cpu.py on tiny runs (its numbers mean nothing here): three runs, the printed ratios
    are the lone run's median rate over each concurrent run's, as the JSON records them."""
    from train_utils import TINY, env

    tiny = [o for o in TINY if not o.startswith(("wandb.", "train.cpu_threads"))]  # the threads train.py picks
    proc = subprocess.run([sys.executable, "scripts/bench_shared_cpu.py", "--steps", "30", "--settle-s", "0",
                           "--keep", str(tmp_path / "runs"), "--json", str(tmp_path / "res.json"),
                           "train.kernels=reference", *tiny],
                          cwd=REPO, env={k: v for k, v in env().items() if k != "OMP_NUM_THREADS"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((tmp_path / "res.json").read_text())
    from normlab.train.run_summary import tokens_per_s

    for name in ("alone", "first", "second"):
        assert (tmp_path / "runs" / name / "summary.json").is_file()
    alone = tokens_per_s(tmp_path / "runs" / "alone" / "metrics.jsonl")
    for name in ("first", "second"):
        ratio = alone / tokens_per_s(tmp_path / "runs" / name / "metrics.jsonl")
        assert res["slowdown"][name] == pytest.approx(ratio, abs=0.005)
        assert f"{res['slowdown'][name]:.2f}x the lone run's time per token" in proc.stdout
    assert "goal: each at most 2.5x" in proc.stdout and res["omp_wait_policy"]
