#!/bin/bash
# docs/study-v6/predictions.md, "Planned wall time": PYTHONPATH=$PWD bash docs/study-v6/timing.sh (prints NAME rc= SECONDS)
# Each arm type's 96-step run (3 evaluations, the study's settings) right after a pre-LN one: ratios, not times.
cd "$(dirname "$0")/../.."   # the repository root
export PYTHONPATH=$PWD HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false
Q="model.hidden_size=64 model.num_hidden_layers=6 model.num_attention_heads=4 model.intermediate_size=256 model.vocab_size=4000 model.hidden_dropout_prob=0.0 model.attention_probs_dropout_prob=0.0 data.max_train_samples=13312 data.max_length=40 data.group_by_length=false train.batch_size=32 train.epochs=1 train.save_steps=416 train.adam_beta2=0.98 wandb.mode=disabled train.lr=1.78e-3 train.warmup_steps=50 seed=0"
run() { # name config extra...
  local name=$1 cfg=$2; shift 2
  local t0=$(date +%s.%N)
  timeout 600 python train.py --config configs/$cfg.yaml $Q train.max_steps=96 train.eval_steps=32 output_dir=${OUT:-/tmp/v6time}/$name-$RANDOM "$@" > ${OUT:-/tmp/v6time}/$name.log 2>&1
  local rc=$?
  echo "$name rc=$rc $(python -c "import time;print(round(time.time()-$t0,1))")"
}
mkdir -p ${OUT:-/tmp/v6time}
P=train.precise_bn_batches=50
while read name cfg extra; do
  run ln_pre pre_ln
  run $name $cfg $extra
done <<ARMS
mbn_g32 masked_batchnorm model.bn_group_size=32 $P
mbn_g8 masked_batchnorm model.bn_group_size=8 $P
mbn_g2 masked_batchnorm model.bn_group_size=2 $P
pn_g2 powernorm model.bn_group_size=2 $P
bn_g2 batchnorm model.bn_group_size=2 $P
std pre_ln model.pooled_norm=standardize
std_gain pre_ln model.pooled_norm=standardize model.pooled_gain=64
final_mbn pre_ln model.final_norm=masked_batchnorm
ln_pre_b8 pre_ln train.batch_size=8 train.max_steps=384 train.eval_steps=128
mbn_b8 masked_batchnorm train.batch_size=8 train.max_steps=384 train.eval_steps=128 $P
ARMS
