#!/bin/bash
# docs/study-v6/notes.md, "What the drift measured" (post hoc): v6 part A's masked-BN arms at g = 32, 8 and 2 retrained
# at masked BN's best LR (1.78e-3) on seeds 0 and 1, logging the lag-free noise beside the drift, then both read back.
#   bash docs/study-v6/noise_check.sh        (OUT=/tmp/v6noise by default; two runs at once)
cd "$(dirname "$0")/../.."   # the repository root
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/v6noise}
Q="model.hidden_size=64 model.num_hidden_layers=6 model.num_attention_heads=4 model.intermediate_size=256 model.vocab_size=4000 model.hidden_dropout_prob=0.0 model.attention_probs_dropout_prob=0.0 data.max_train_samples=13312 data.max_length=40 data.group_by_length=false train.batch_size=32 train.epochs=1 train.save_steps=416 train.adam_beta2=0.98 train.lr=1.78e-3 train.warmup_steps=50 train.eval_steps=32 train.precise_bn_batches=50 train.cpu_threads=1 wandb.mode=disabled"
for seed in 0 1; do
  for g in 32 8 2; do
    python train.py --config configs/masked_batchnorm.yaml $Q model.bn_group_size=$g seed=$seed output_dir=$OUT/g$g-s$seed > $OUT-g$g-s$seed.log 2>&1 &
    [ "$g" = 8 ] && wait   # two at a time
  done
  wait
done
python - "$OUT" <<'PY'
import json, math, sys
from pathlib import Path
def mean(xs): return sum(xs) / len(xs)
rows = {}
for run in sorted(Path(sys.argv[1]).iterdir()):
    logged = [json.loads(x) for x in (run / "metrics.jsonl").open()]
    def over(metric, after=0):  # each row's mean over blocks, then the mean over the rows that have it
        return mean([mean([v for k, v in e.items() if k.startswith("bn/") and k.endswith(metric)]) for e in logged
                     if any(k.endswith(metric) for k in e) and e.get("step", 0) > after])
    # noise: at each evaluation, against the population of the same weights; drift: v6's measure, every logged step
    # after warmup, against the running statistics
    rows[run.name] = {"/stat_noise": over("/stat_noise"), "/stat_drift": over("/stat_drift", after=50)}
    print(run.name, {m.strip("/"): round(v, 4) for m, v in rows[run.name].items()})
for seed in (0, 1):
    for g in (8, 2):
        a, b = rows[f"g{g}-s{seed}"], rows[f"g32-s{seed}"]
        print(f"seed {seed}, g = {g} / g = 32: noise {a['/stat_noise'] / b['/stat_noise']:.2f}x, "
              f"drift {a['/stat_drift'] / b['/stat_drift']:.2f}x")
PY
