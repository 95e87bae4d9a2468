"""Study v6's pilot measurement (docs/study-v6/predictions.md, "The fixed gain"): how large the sentence-specific
part of what the classifier reads is after 16 steps, and how spread its logits are across sentences.

Trains each arm with quick_v4's settings (configs/study/quick_v4.yaml: 6 layers, width 64, batch 32, max_length 40,
416-step schedule, warmup 50) at one LR, stops it once step 16's checkpoint is written, and on the first 256
validation sentences (one batch of 256, train mode: the statistics a training step would use) reports
  pooled_sd   per-feature SD across sentences of the pooled vector, the median over the 64 features
  input_sd    the same for what the classifier's linear layer reads (after pooled_norm and pooled_gain)
  logit_sd    SD across sentences of the logit difference (class 1 - class 0)

    PYTHONPATH=$PWD python docs/study-v6/pooled_sd.py --out /tmp/pooled_sd --seeds 0 1 2 --lr 1.78e-3 \\
        --arm ln_pre= --arm center=model.pooled_norm=center ...
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from model import NormLabForSequenceClassification
from model.modeling_normlab import pool_tokens
from normlab.files.formats import read_yaml
from normlab.study.study_dir import provenance

REPO = Path(__file__).resolve().parents[2]
STEP = 16


def train_to_step(out: Path, seed: int, lr: float, overrides: list[str]) -> Path:
    """Run train.py with quick_v4's overrides until checkpoints/step_16 exists, then stop it; the checkpoint."""
    study = read_yaml(REPO / "configs/study/quick_v4.yaml")
    given = [f"{k}={v}" for k, v in study["overrides"].items()]
    argv = [sys.executable, "train.py", "--config", "configs/pre_ln.yaml", *given, f"train.lr={lr}",
            "train.warmup_steps=50", f"seed={seed}", f"train.save_steps={STEP}", f"output_dir={out}", *overrides]
    ckpt = out / "checkpoints" / f"step_{STEP}"
    if (ckpt / "trainer_state.json").exists():  # measured before: the same checkpoint again
        return ckpt
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        while not (ckpt / "trainer_state.json").exists():
            if proc.poll() is not None:
                raise SystemExit(f"{out}: train.py ended ({proc.returncode}) before step {STEP}; see its log")
            time.sleep(0.5)
        proc.terminate()
        proc.wait()
    return ckpt


def probe_batch(n: int = 256, max_length: int = 40) -> dict:
    """The first n validation sentences, tokenized by the run's own tokenizer (saved with the checkpoint)."""
    import pandas as pd

    rows = pd.read_parquet(REPO.parent / "shared/datasets/sst2/validation.parquet").head(n)
    return {"texts": rows["sentence"].tolist(), "max_length": max_length}


@torch.no_grad()
def measure(ckpt: Path, probe: dict) -> dict:
    from transformers import AutoTokenizer

    model = NormLabForSequenceClassification.from_pretrained(ckpt).train()  # dropout is 0 in these runs
    tok = AutoTokenizer.from_pretrained(ckpt)
    enc = tok(probe["texts"], padding=True, truncation=True, max_length=probe["max_length"], return_tensors="pt")
    seen = {}
    model.classifier.register_forward_pre_hook(lambda mod, args: seen.update(x=args[0]))
    logits = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits
    hidden = model.normlab(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).last_hidden_state
    pooled = pool_tokens(hidden, enc["attention_mask"], model.config.pooling)
    return {"pooled_sd": float(pooled.std(0).median()), "input_sd": float(seen["x"].std(0).median()),
            "logit_sd": float((logits[:, 1] - logits[:, 0]).std())}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--lr", type=float, default=1.78e-3)
    p.add_argument("--arm", action="append", required=True, help="NAME=key=value,key=value (NAME= for none)")
    args = p.parse_args()
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled",
                      TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    probe = probe_batch()
    args.out.mkdir(parents=True, exist_ok=True)
    for arm in args.arm:
        name, _, given = arm.partition("=")
        for seed in args.seeds:
            ckpt = train_to_step(args.out / f"{name}-s{seed}", seed, args.lr, [o for o in given.split(",") if o])
            row = {"variant": name, "seed": seed, "lr": args.lr, "step": STEP, **measure(ckpt, probe),
                   **provenance()}  # commit, machine, time: every row says where it was measured
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
