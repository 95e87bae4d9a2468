#!/usr/bin/env bash
# One prepared check of NormLab's GPU paths, on a machine with one NVIDIA GPU (within a 10-minute budget, below):
#
#   bash scripts/gpu_check.sh [--cpu] [OUT_DIR]            # OUT_DIR default: runs/gpu_check-<time>/report
#
#   1. environment  versions, the GPU; `datasets` from the wheels in .whl/ when it is not installed
#                   (make them on a machine with the package registry: python scripts/gpu_check.py wheels);
#                   no wandb needed: every run uses wandb.mode=disabled wandb.report_to=none
#   2. kernels      CustomLayerNorm vs torch.nn.LayerNorm on CUDA, float32 and bf16 autocast; a fully padded
#                   sequence under bf16/fp16 autocast gives finite outputs (scripts/gpu_check.py kernels)
#   3. steps        30 steps of the default, masked_batchnorm and powernorm configs with
#                   configs/accelerate/single_gpu_bf16.yaml and with fsdp.yaml (one process), and the default
#                   with single_gpu_fp16.yaml (loss scaling); running statistics must stay float32
#   4. epoch        the default run (accelerate launch train.py, one epoch of SST-2) with single_gpu_bf16.yaml:
#                   wall time, median real tokens/s, accuracy in OUT_DIR/default_epoch.json for the README
#   5. bench        python scripts/bench.py --device cuda --repeats 5
#
# Data: SST-2 from $NORMLAB_DATA_DIR/sst2, else .gpudata/sst2, else ../shared/datasets/sst2 (train.py's lookup).
# Results go to OUT_DIR (small files: JSON, logs, summary.txt, the epoch run's summary.json and metrics.jsonl); the
# run directories (checkpoints: large) to $GPU_CHECK_RUNS, default OUT_DIR/../runs.
# Every step runs even if an earlier one failed, each within what is left of $GPU_CHECK_BUDGET_S (default 570 s:
# the whole check ends before a 10-minute limit, with summary.txt written); the exit code is 0 only when all passed.
# --cpu: the same steps, tiny and on the CPU, to test this script without a GPU (tests/test_gpu_check.py);
#        FSDP is skipped there (accelerate runs FSDP only on accelerators; tests/test_precision.py covers it on CPU).
# GPU_CHECK_STEPS="kernels steps bench epoch" and GPU_CHECK_VARIANTS="default masked_batchnorm powernorm" (the
# defaults) select what runs.
set -uo pipefail
cd "$(dirname "$0")/.."

CPU=0
if [ "${1:-}" = "--cpu" ]; then CPU=1; shift; fi
OUT=${1:-runs/gpu_check-$(date +%Y%m%d-%H%M%S)/report}
RUNS=${GPU_CHECK_RUNS:-$(dirname "$OUT")/runs}
BUDGET=${GPU_CHECK_BUDGET_S:-570}
mkdir -p "$OUT/logs" "$RUNS"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
FAILED=0
SECTIONS=" ${GPU_CHECK_STEPS:-kernels steps bench epoch} "
VARIANTS=(${GPU_CHECK_VARIANTS:-default masked_batchnorm powernorm})
wanted() { [[ "$SECTIONS" == *" $1 "* ]]; }

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
if [ -z "${NORMLAB_DATA_DIR:-}" ] && [ -d .gpudata ]; then export NORMLAB_DATA_DIR=$PWD/.gpudata; fi
PY=${PYTHON:-python}
LAUNCH=("$PY" -m accelerate.commands.launch)
NO_WANDB=(wandb.mode=disabled wandb.report_to=none)

# step NAME TIMEOUT_S CMD...: run with a time limit (at most what is left of the budget), log to
# OUT/logs/NAME.log, record ok/FAIL in summary.txt
step() {
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS left=$((BUDGET - SECONDS))
    if [ $left -lt 5 ]; then
        printf '%-28s %-40s\n' "$name" "FAIL (not run: the ${BUDGET}s budget is spent)" | tee -a "$SUMMARY"
        FAILED=1; return
    fi
    [ "$limit" -gt $left ] && limit=$left
    echo "== $name: $*"
    timeout "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
    local rc=$?
    local status=ok
    if [ $rc -ne 0 ]; then status="FAIL (exit $rc$([ $rc -eq 124 ] && echo ", timed out after ${limit}s"))"; FAILED=1; fi
    printf '%-28s %-40s %4ds\n' "$name" "$status" $((SECONDS - t0)) | tee -a "$SUMMARY"
    [ "$status" = ok ] || tail -5 "$OUT/logs/$name.log"
}

# ---- 1. environment
if ! "$PY" -c "import datasets" 2>/dev/null; then
    if ls .whl/*.whl > /dev/null 2>&1; then
        echo "datasets is not installed: installing the wheels of .whl/ into .whl/site"
        "$PY" -m pip install --quiet --no-index --no-deps --target .whl/site .whl/*.whl || FAILED=1
        export PYTHONPATH=$PWD/.whl/site${PYTHONPATH:+:$PYTHONPATH}
    else
        echo "datasets is not installed and .whl/ holds no wheels (python scripts/gpu_check.py wheels, on a" \
             "machine with the package registry); the training steps will fail" | tee -a "$SUMMARY"
    fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
    date -u +"%Y-%m-%dT%H:%M:%SZ"; git rev-parse HEAD 2>/dev/null; git status --short 2>/dev/null | head -20
    command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    "$PY" - <<'EOF'
import importlib, platform, torch
print("python", platform.python_version())
for name in ("torch", "transformers", "accelerate", "tokenizers", "triton", "datasets", "pyarrow", "wandb"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:  # noqa: BLE001 - report whatever is missing
        print(name, "missing:", type(e).__name__)
print("cuda available", torch.cuda.is_available(), torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "")
print("bf16 supported", torch.cuda.is_available() and torch.cuda.is_bf16_supported())
EOF
    echo "NORMLAB_DATA_DIR=${NORMLAB_DATA_DIR:-}"
} > "$OUT/environment.txt" 2>&1
cat "$OUT/environment.txt"

if [ $CPU = 1 ]; then
    DEVICE=cpu
    STEPS=2
    TINY=(model.hidden_size=32 model.num_hidden_layers=2 model.num_attention_heads=2 model.intermediate_size=64
          model.vocab_size=1000 data.max_train_samples=200 data.max_eval_samples=64 train.batch_size=16
          train.warmup_steps=1 train.cpu_threads=1)
    EPOCH=("${TINY[@]}" train.max_steps=4)
    BENCH=(--device cpu --quick --no-compile --repeats 1 --batches 1)
    CONFIGS=(single_gpu_bf16)
else
    DEVICE=cuda
    STEPS=30
    TINY=()
    EPOCH=()
    BENCH=(--device cuda --repeats 5)
    CONFIGS=(single_gpu_bf16 fsdp)
fi

# ---- 2. kernels
wanted kernels && step kernels 600 "$PY" scripts/gpu_check.py kernels --device $DEVICE --out "$OUT/kernels.json"

# ---- 3. a few steps of each config under each launch config
RUN_DIRS=()
wanted steps || CONFIGS=()
for launch in "${CONFIGS[@]}"; do
    for variant in "${VARIANTS[@]}"; do
        name=${variant}-${launch}
        config=(); [ "$variant" != default ] && config=(--config "$variant")
        step "steps-$name" 600 "${LAUNCH[@]}" --config_file "configs/accelerate/$launch.yaml" --num_processes 1 \
            train.py ${config[@]+"${config[@]}"} "output_dir=$RUNS/$name" ${TINY[@]+"${TINY[@]}"} "train.max_steps=$STEPS" \
            "train.eval_steps=$STEPS" "train.save_steps=$STEPS" "${NO_WANDB[@]}"
        RUN_DIRS+=("$RUNS/$name")
    done
done
if [ $CPU = 0 ] && wanted steps; then
    step "steps-default-single_gpu_fp16" 600 "${LAUNCH[@]}" --config_file configs/accelerate/single_gpu_fp16.yaml \
        train.py "output_dir=$RUNS/default-single_gpu_fp16" "train.max_steps=$STEPS" "train.eval_steps=$STEPS" \
        "train.save_steps=$STEPS" "${NO_WANDB[@]}"
    RUN_DIRS+=("$RUNS/default-single_gpu_fp16")
fi
[ ${#RUN_DIRS[@]} -gt 0 ] && step steps-summary 60 "$PY" scripts/gpu_check.py summarize --out "$OUT/steps.json" "${RUN_DIRS[@]}"

# ---- 4. the default one-epoch run
if wanted epoch; then
    step default-epoch 1200 "${LAUNCH[@]}" --config_file configs/accelerate/single_gpu_bf16.yaml train.py \
        "output_dir=$RUNS/default_epoch" ${EPOCH[@]+"${EPOCH[@]}"} "${NO_WANDB[@]}"
    step default-epoch-summary 60 "$PY" scripts/gpu_check.py summarize --out "$OUT/default_epoch.json" \
        "$RUNS/default_epoch"
    cp "$RUNS/default_epoch/summary.json" "$OUT/default_epoch_summary.json" 2>/dev/null
    cp "$RUNS/default_epoch/metrics.jsonl" "$OUT/default_epoch_metrics.jsonl" 2>/dev/null
fi

# ---- 5. bench
wanted bench && step bench 900 "$PY" scripts/bench.py "${BENCH[@]}" --out "$OUT/bench.json"

echo "results in $OUT (summary.txt):"
cat "$SUMMARY"
exit $FAILED
