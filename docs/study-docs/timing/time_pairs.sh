#!/bin/bash
# One 20-step run of each arm type of study "docs", each right after a pre-LN run on SST-2 sentences at study v4's
# quick settings (the reference), one thread each; rounds alternate the arms' order. From the repository root:
#   ROUNDS="3 4" OUT=/tmp/docs_timing/runs docs/study-docs/timing/time_pairs.sh >> pairs.txt
# Each line: run, round, arm it is paired with, status, step_time_s, wall_time_s (summary.json).
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/docs_timing/runs}
M="model.hidden_size=64 model.num_hidden_layers=6 model.num_attention_heads=4 model.intermediate_size=256
   model.vocab_size=4000 model.hidden_dropout_prob=0 model.attention_probs_dropout_prob=0 train.batch_size=32
   train.adam_beta2=0.98 train.warmup_steps=50 train.lr=1.78e-3 train.cpu_threads=1 wandb.mode=disabled
   train.max_steps=20 train.eval_steps=20 train.save_steps=20"
SENT="data.max_train_samples=13312 data.max_length=40 data.group_by_length=false"
DOCS="data.doc_sizes=[1,3,5,7] data.max_length=256 model.max_position_embeddings=256"
declare -A ARM=(
  [ref_sentences]="--config pre_ln $SENT"
  [ln_random]="--config pre_ln $DOCS data.group_by_length=false"
  [ln_grouped]="--config pre_ln $DOCS data.group_by_length=true"
  [bn_random]="--config batchnorm $DOCS data.group_by_length=false"
  [bn_grouped]="--config batchnorm $DOCS data.group_by_length=true"
  [mbn_random]="--config masked_batchnorm $DOCS data.group_by_length=false"
  [mbn_grouped]="--config masked_batchnorm $DOCS data.group_by_length=true"
)
ARMS="ln_random ln_grouped bn_random bn_grouped mbn_random mbn_grouped"
for round in ${ROUNDS:-3 4}; do
  list=$ARMS; [ $((round % 2)) = 0 ] && list=$(echo $ARMS | tr ' ' '\n' | tac | tr '\n' ' ')
  for a in $list; do
    for run in ref_sentences $a; do
      name=$run-$round-$a
      rm -rf "$OUT/$name"
      timeout 600 python train.py ${ARM[$run]} $M output_dir=$OUT/$name > "$OUT/$name.log" 2>&1
      python -c "import json; s=json.load(open('$OUT/$name/summary.json')); print('$run', $round, '$a', s['status'], s['step_time_s'], s['wall_time_s'])"
    done
  done
done
