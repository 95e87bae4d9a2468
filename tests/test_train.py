"""train.py end to end on a tiny model and 300 rows of the shared SST-2: `accelerate launch`, the run directory,
metrics.jsonl's stability metrics, offline wandb, final/ loading in a fresh process, two CPU processes (LR
schedule, masked-BN statistics in sync), the MLM task, gradient accumulation, torch.compile."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import yaml

import normlab.kernels
from train_utils import (
    REFERENCE,
    REPO,
    accelerate_cmd,
    assert_same_weights,
    env,
    final_weights,
    free_port,
    losses,
    rows,
    run_cmd,
    run_here,
    summary,
    train_rows,
)

pytestmark = pytest.mark.slow  # accelerate launch end to end, several processes, compile: full training runs

LAYER_KEYS = ("grad_norm", "act_rms", "attn_logit_max", "update_ratio")
TRAIN_KEYS = ("train/loss", "train/lr", "train/grad_norm", "train/pad_fraction", "train/tokens_per_s",
              "events/loss_spike", "events/nonfinite")


def expected_lrs(base_lr, warmup, total):
    """The LR of optimizer steps 1..total under transformers' linear schedule on one process."""
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base_lr)
    sched = get_scheduler("linear", opt, num_warmup_steps=warmup, num_training_steps=total)
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def test_accelerate_launch_end_to_end(tmp_path):
    out = tmp_path / "run"
    result = run_cmd(accelerate_cmd(out, "train.max_steps=12", "train.eval_steps=6", "train.save_steps=6",
                                    "wandb.mode=offline", "wandb.tags=smoke"))
    assert result.returncode == 0, result.stderr[-3000:]

    # the run directory the README describes
    for name in ("config.yaml", "metrics.jsonl", "summary.json", "checkpoints/step_12", "final", "wandb"):
        assert (out / name).exists(), name
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    assert cfg["model"]["hidden_size"] == 32 and cfg["train"]["max_steps"] == 12
    s = summary(out)
    assert s["status"] == "completed" and s["step"] == 12 and s["loss_spikes"] == 0
    # train.kernels=auto: the C++ kernels ran, or the reference did and one warning said why
    assert cfg["train"]["kernels"] == "auto"
    assert set(s["kernels"]) == set(normlab.kernels.OPS)
    # the C++ dropout and attention come with the C++ backend, else nn.Dropout and SDPA
    swapped_in = {s["kernels"].pop(op) for op in normlab.kernels.SWAPPED_IN}
    backends = set(s["kernels"].values())
    assert (backends == {"cpp"} and swapped_in == {"cpp"}) or (
        backends == {"reference"} and swapped_in == {"torch"} and "cpp backend for cpu is unavailable" in result.stderr)
    assert set(s["final"]) == {"eval/loss", "eval/accuracy"} and 0 <= s["final"]["eval/accuracy"] <= 1

    # metrics.jsonl: every step has the stability metrics; evaluations at 6 and 12
    train = train_rows(out)
    assert [r["step"] for r in train] == list(range(1, 13))
    for r in train:
        for key in TRAIN_KEYS + tuple(f"layers/{i}/{k}" for i in range(2) for k in LAYER_KEYS):
            assert key in r, key
            assert r[key] is not None and math.isfinite(r[key]), (key, r[key])
        assert 0 <= r["train/pad_fraction"] < 0.5 and r["train/tokens_per_s"] > 0
        assert r["layers/1/attn_logit_max"] != 0 and r["layers/0/act_rms"] > 0
    assert all(r["layers/0/update_ratio"] > 0 for r in train[1:])  # step 1 has lr 0 (warmup)
    assert [r["step"] for r in rows(out) if "eval/accuracy" in r] == [6, 12]

    # offline wandb run, grouped by norm-placement
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))

    # final/ loads with the Auto class in a fresh process where the repo's `model` package is not importable
    probe = (
        "import sys, json, torch\n"
        "from transformers import AutoModelForSequenceClassification, AutoTokenizer\n"
        f"path = {str(out / 'final')!r}\n"
        "model = AutoModelForSequenceClassification.from_pretrained(path, trust_remote_code=True).eval()\n"
        "tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)  # v5 reads config.json first\n"
        "assert 'model' not in sys.modules or not hasattr(sys.modules['model'], 'NormLabConfig')\n"
        "enc = tok(['a gripping , funny film'], return_tensors='pt')\n"
        "with torch.no_grad(): print(json.dumps(model(**enc).logits[0].tolist()))\n"
    )
    e = env()
    e.pop("PYTHONPATH")
    fresh = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=e, capture_output=True, text=True,
                           timeout=120)
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    from transformers import AutoTokenizer

    from model import NormLabForSequenceClassification

    local = NormLabForSequenceClassification.from_pretrained(out / "final").eval()
    enc = AutoTokenizer.from_pretrained(out / "final")(["a gripping , funny film"], return_tensors="pt")
    with torch.no_grad():
        expected = local(**enc).logits[0]
    assert torch.allclose(torch.tensor(json.loads(fresh.stdout.strip().splitlines()[-1])), expected, atol=1e-6)
    # every checkpoint carries the tokenizer too, so AutoTokenizer loads from any checkpoint
    for ckpt in sorted((out / "checkpoints").glob("step_*")):
        final_vocab = AutoTokenizer.from_pretrained(out / "final").get_vocab()
        assert AutoTokenizer.from_pretrained(ckpt).get_vocab() == final_vocab
    card = (out / "final" / "README.md").read_text()
    assert "custom_layernorm" in card and "eval/accuracy" in card


def test_two_cpu_processes_keep_the_lr_schedule_and_masked_bn_in_sync(tmp_path):
    out = tmp_path / "ddp"
    cmd = accelerate_cmd(out, "model.norm=masked_batchnorm", "train.max_steps=10", "train.eval_steps=5",
                         "train.save_steps=5", "train.warmup_steps=3",
                         launch_args=("--config_file", str(REPO / "configs/accelerate/cpu_2proc.yaml"),
                                      "--main_process_port", str(free_port())))
    result = run_cmd(cmd)
    assert result.returncode == 0, result.stderr[-3000:]
    s = summary(out)
    assert s["status"] == "completed" and s["num_processes"] == 2 and s["step"] == 10
    # the prepared scheduler steps once per process: train.py scales it, so the LR per optimizer step is the
    # single-process schedule
    logged = [r["train/lr"] for r in train_rows(out)]
    assert logged == pytest.approx(expected_lrs(2e-3, 3, 10), rel=1e-6, abs=1e-12)
    # masked BN all-reduces its statistics: every process holds the same running statistics
    assert s["bn_running_stats_max_diff_across_processes"] == 0.0
    r = train_rows(out)[-1]
    assert all(math.isfinite(r[f"bn/{i}/stat_drift"]) for i in range(2))
    assert "eval/accuracy_batch_stats" in s["final"]



def test_dev_rows_choose_the_best_evaluation_and_leave_training_as_it_was(tmp_path, reference):
    """data.dev_rows: every evaluation also scores the held-out dev rows (dev/loss, dev/accuracy) and the best
    evaluation is chosen on them; the training itself (losses, final weights, validation metrics) is bit for bit
    the run without them."""
    out = tmp_path / "dev"
    assert run_here(out, *REFERENCE, "data.dev_rows=64") == 0
    assert losses(out) == losses(reference)
    assert_same_weights(final_weights(out), final_weights(reference))
    evals, before = ([r for r in rows(o) if "eval/loss" in r] for o in (out, reference))
    assert [{k: v for k, v in r.items() if not k.startswith("dev/")} for r in evals] == before
    assert all(0 <= r["dev/accuracy"] <= 1 and r["dev/loss"] > 0 for r in evals)
    best = max(evals, key=lambda r: r["dev/accuracy"])  # the first of a tie, as train.py keeps it
    assert summary(out)["best"] == {"step": best["step"], **{k: v for k, v in best.items() if "/" in k}}

def test_evaluating_more_often_leaves_training_as_it_was(tmp_path):
    """Evaluation runs in eval mode under a forked RNG and touches no weight or statistic, so how often a run
    evaluates changes only its eval rows: the study's LR sweeps evaluate once, at the end, on that promise. Naive
    BN: running statistics, and an extra evaluation with the batches' own statistics."""
    steps = ["model.norm=batchnorm", "train.max_steps=12", "train.save_steps=12"]
    often, once = tmp_path / "often", tmp_path / "once"
    assert run_here(often, *steps, "train.eval_steps=2") == 0
    assert run_here(once, *steps, "train.eval_steps=12") == 0
    assert train_rows(often) == [{**r, "train/tokens_per_s": o["train/tokens_per_s"]}
                                 for r, o in zip(train_rows(once), train_rows(often))]  # all but the timing
    assert_same_weights(final_weights(often), final_weights(once))
    evals = [[r for r in rows(o) if "eval/loss" in r] for o in (often, once)]
    assert [r["step"] for r in evals[0]] == [2, 4, 6, 8, 10, 12] and evals[0][-1] == evals[1][0]
    assert "eval/accuracy_batch_stats" in evals[1][0]


def test_mlm_task(tmp_path):
    out = tmp_path / "mlm"
    assert run_here(out, "task=mlm", "train.max_steps=6", "train.eval_steps=100") == 0
    s = summary(out)
    assert s["status"] == "completed"
    assert s["final"]["eval/loss"] < math.log(1000) + 1 and 0 <= s["final"]["eval/accuracy"] <= 1
    from transformers import AutoModelForMaskedLM

    model = AutoModelForMaskedLM.from_pretrained(out / "final", trust_remote_code=True)
    assert type(model).__name__ == "NormLabForMaskedLM"


def test_gradient_accumulation_and_log_steps(tmp_path):
    out = tmp_path / "accum"
    # 300 rows / batch 16 = 19 micro-batches per epoch -> 10 optimizer steps with 2 micro-batches each
    assert run_here(out, "train.grad_accum_steps=2", "train.epochs=1", "train.log_steps=3",
                    "train.eval_steps=100", "train.save_steps=100") == 0
    s = summary(out)
    assert s["status"] == "completed" and s["total_steps"] == 10 and s["step"] == 10
    assert [step for step, _ in losses(out)] == [3, 6, 9]
    assert [r["step"] for r in rows(out) if "eval/loss" in r] == [10]
    assert (out / "checkpoints" / "step_10").is_dir()


def test_torch_compile(tmp_path):
    # aot_eager: dynamo's graph capture and AOTAutograd, as with the default inductor backend, without the C++
    # code generation, slow on a small shared CPU
    out = tmp_path / "compiled"
    assert run_here(out, "train.compile=true", "train.compile_backend=aot_eager", "train.max_steps=2",
                    "train.eval_steps=100", "data.max_eval_samples=16") == 0
    s = summary(out)
    assert s["status"] == "completed" and s["step"] == 2
    assert all(math.isfinite(loss) for _, loss in losses(out))
    # parameter names are the plain model's (compiled in place), so final/ loads as usual
    from model import NormLabForSequenceClassification

    NormLabForSequenceClassification.from_pretrained(out / "final")


def test_train_kernels_reference_is_recorded(tmp_path):
    before = normlab.kernels.backends("cpu")["normlab::layer_norm"]
    out = tmp_path / "reference"
    try:
        assert run_here(out, "train.kernels=reference", "train.max_steps=2", "train.eval_steps=100",
                        "data.max_eval_samples=16") == 0
    finally:
        normlab.kernels.enable("auto" if before == "cpp" else "reference", "cpu")
    assert summary(out)["kernels"] == {"normlab::layer_norm": "reference", "normlab::layer_norm_backward": "reference",
                                       "normlab::dropout": "torch", "normlab::attention": "torch",
                                       "normlab::attention_backward": "torch"}
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["kernels"] == "reference"


def test_plain_accelerate_launch_uses_the_cores(tmp_path):
    """End to end: under plain `accelerate launch` (which exports OMP_NUM_THREADS=1) a CPU run still uses the
    cores, and summary.json says how many threads it ran with."""
    import psutil

    expected = max(1, min(psutil.cpu_count(logical=False) or 1, len(os.sched_getaffinity(0))))
    out = tmp_path / "run"
    res = run_cmd(accelerate_cmd(out, "train.max_steps=2", "train.eval_steps=100", "train.save_steps=100",
                                 "train.cpu_threads=null"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert summary(out)["cpu_threads"] == expected
    res = run_cmd(accelerate_cmd(tmp_path / "one", "train.max_steps=2", "train.eval_steps=100"))  # TINY pins 1
    assert res.returncode == 0, res.stderr[-2000:]
    assert summary(tmp_path / "one")["cpu_threads"] == 1
