#!/usr/bin/env bash
# One prepared check of NormLab's GPU paths on a machine with one NVIDIA GPU and no package registry (docs/gpu.md
# has the device call that runs it and what to do with the result):
#
#   bash scripts/gpu_check.sh [--cpu]
#
# Before: python scripts/gpu_prepare.py (where pip reaches a registry) puts the wheels the GPU image lacks in .whl/
# and SST-2 in .gpudata/; this script installs the wheels into its work folder and points train.py at the data.
# Sections, most important first, so a check cut short still returns what matters most:
#   1. triton     tests/test_triton_layer_norm.py (on a GPU its CUDA tests run too)
#   2. ln-bench   scripts/ln_bench.py: Triton vs torch LayerNorm, eager and compiled, fp32 and bf16, bandwidth
#                 against a copy on the same GPU
#   3. kernels    scripts/gpu_check.py kernels: the Triton backend registered and launched, judged against float64;
#                 a fully padded sequence under bf16/fp16 autocast stays finite
#   4. steps      30 steps of default, masked_batchnorm, powernorm (bf16), default under fp16 and under FSDP
#   5. epoch      the default run, one epoch of SST-2 (bf16): wall time, tokens/s, accuracy
#   6. bench      scripts/bench.py --device cuda (whatever time is left)
# Where results go: a work folder ($GPU_CHECK_WORK, default a new /tmp/gpu_check.XXXXXX) holds report/ (small
# files: logs, JSON) and runs/ (checkpoints, never returned). After every section report/ is packed into
# $DEST/gpu_check_report.tar.gz and summary.txt is copied beside it: DEST is $GPU_CHECK_DEST, else the device's
# returned folder $OUT, else runs/gpu_check-<time>. Two files: the device returns at most eight.
# Time: every section runs within what is left of $GPU_CHECK_BUDGET_S (default 360 s; --cpu 1800) and within its
# own limit; a section not started for lack of time is reported as such. Exit code 0 only when every section passed.
# Python: $PYTHON, default python3 (the image's; it has no `python`).
# --cpu: the same sections, tiny and on the CPU (tests/test_gpu_check.py rehearses the check with it); fp16 and
#        FSDP steps are GPU-only (accelerate refuses them on a CPU; tests/test_precision.py covers them there).
# GPU_CHECK_SECTIONS="triton ln-bench kernels steps epoch bench" (the default) selects sections.
set -uo pipefail
cd "$(dirname "$0")/.."

CPU=0
if [ "${1:-}" = "--cpu" ]; then CPU=1; fi
PY=${PYTHON:-python3}
DEST=${GPU_CHECK_DEST:-${OUT:-runs/gpu_check-$(date +%Y%m%d-%H%M%S)}}
WORK=${GPU_CHECK_WORK:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
WHEELS=${GPU_CHECK_WHEELS:-.whl}
BUDGET=${GPU_CHECK_BUDGET_S:-360}
SCALE=1  # --cpu: every limit 5 times longer (a small, shared CPU; the budget too, unless set)
if [ $CPU = 1 ]; then SCALE=5; BUDGET=${GPU_CHECK_BUDGET_S:-1800}; fi
REPORT=$WORK/report
RUNS=$WORK/runs
mkdir -p "$DEST" "$REPORT/logs" "$RUNS"
SUMMARY="$REPORT/summary.txt"
: > "$SUMMARY"
FAILED=0
SECTIONS=" ${GPU_CHECK_SECTIONS:-triton ln-bench kernels steps epoch bench} "
wanted() { [[ "$SECTIONS" == *" $1 "* ]]; }

# publish: the report so far, packed into DEST (what the device returns even if the check is killed later)
publish() {
    cp "$SUMMARY" "$DEST/summary.txt"
    tar -czf "$DEST/gpu_check_report.tar.gz.part" -C "$WORK" report && \
        mv "$DEST/gpu_check_report.tar.gz.part" "$DEST/gpu_check_report.tar.gz"
}

# step NAME LIMIT_S CMD...: run within its limit and what is left of the budget, log to report/logs/NAME.log,
# record ok/FAIL in summary.txt, publish
step() {
    local name=$1 limit=$(($2 * SCALE)); shift 2
    local t0=$SECONDS left=$((BUDGET - SECONDS))
    if [ $left -lt 10 ]; then
        printf '%-34s %s\n' "$name" "FAIL (not run: the ${BUDGET}s budget is spent)" | tee -a "$SUMMARY"
        FAILED=1; publish; return
    fi
    [ "$limit" -gt $left ] && limit=$left
    echo "== $name: $*"
    timeout "$limit" "$@" > "$REPORT/logs/$name.log" 2>&1
    local rc=$?
    local status=ok
    if [ $rc -ne 0 ]; then status="FAIL (exit $rc$([ $rc -eq 124 ] && echo ", timed out after ${limit}s"))"; FAILED=1; fi
    printf '%-34s %-40s %4ds\n' "$name" "$status" $((SECONDS - t0)) | tee -a "$SUMMARY"
    [ "$status" = ok ] || tail -5 "$REPORT/logs/$name.log"
    publish
}

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled PYTHONUNBUFFERED=1
if [ -z "${NORMLAB_DATA_DIR:-}" ] && [ -d .gpudata ]; then export NORMLAB_DATA_DIR=$PWD/.gpudata; fi
export NORMLAB_CACHE=${NORMLAB_CACHE:-$WORK/cache}

# ---- 0. the carried wheels, then the environment
CARRIED=("$WHEELS"/*.whl)
[ -e "${CARRIED[0]}" ] || CARRIED=()
if [ ${#CARRIED[@]} -gt 0 ]; then
    step wheels 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$WORK/site" "${CARRIED[@]}"
    export PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}
fi
# nothing of NormLab is pip-installed on the image: its packages (model/, common/, ...) are imported from here
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
    date -u +"%Y-%m-%dT%H:%M:%SZ"; git rev-parse HEAD 2>/dev/null; git status --short 2>/dev/null | head -20
    command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
    "$PY" scripts/gpu_check.py environment ${CARRIED[@]+"${CARRIED[@]}"}
    echo "NORMLAB_DATA_DIR=${NORMLAB_DATA_DIR:-} DEST=$DEST WORK=$WORK"
} > "$REPORT/environment.txt" 2>&1
cat "$REPORT/environment.txt"
publish

if [ $CPU = 1 ]; then
    DEVICE=cpu STEPS=2
    TINY=(model.hidden_size=32 model.num_hidden_layers=2 model.num_attention_heads=2 model.intermediate_size=64
          model.vocab_size=1000 data.max_train_samples=200 data.max_eval_samples=64 train.batch_size=16
          train.warmup_steps=1 train.cpu_threads=1)
    EPOCH=("${TINY[@]}" train.max_steps=4)
    LN_BENCH=(--device cpu --quick --no-compile)
    BENCH=(--device cpu --quick --no-compile --repeats 1 --batches 1)
    LAUNCHES=(single_gpu_bf16:powernorm)
else
    DEVICE=cuda STEPS=30 TINY=() EPOCH=()
    LN_BENCH=(--device cuda)
    BENCH=(--device cuda --repeats 3)
    LAUNCHES=(single_gpu_bf16:default single_gpu_bf16:masked_batchnorm single_gpu_bf16:powernorm
              single_gpu_fp16:default fsdp:default)
fi
LAUNCH=("$PY" -m accelerate.commands.launch --num_processes 1)
NO_WANDB=(wandb.mode=disabled wandb.report_to=none)

# ---- 1-3. the kernels
wanted triton && step triton 150 "$PY" -m pytest -q -p no:cacheprovider tests/test_triton_layer_norm.py
wanted ln-bench && step ln-bench 150 "$PY" scripts/ln_bench.py "${LN_BENCH[@]}" --out "$REPORT/ln_bench.json"
wanted kernels && step kernels 90 "$PY" scripts/gpu_check.py kernels --device $DEVICE --out "$REPORT/kernels.json"

# ---- 4. a few steps of each config under each launch config
RUN_DIRS=()
wanted steps || LAUNCHES=()
for pair in ${LAUNCHES[@]+"${LAUNCHES[@]}"}; do
    launch=${pair%%:*} variant=${pair#*:}
    config=(); [ "$variant" != default ] && config=(--config "$variant")
    step "steps-$variant-$launch" 90 "${LAUNCH[@]}" --config_file "configs/accelerate/$launch.yaml" train.py \
        ${config[@]+"${config[@]}"} "output_dir=$RUNS/$variant-$launch" ${TINY[@]+"${TINY[@]}"} \
        "train.max_steps=$STEPS" "train.eval_steps=$STEPS" "train.save_steps=$STEPS" "${NO_WANDB[@]}"
    RUN_DIRS+=("$RUNS/$variant-$launch")
done
[ ${#RUN_DIRS[@]} -gt 0 ] && step steps-summary 60 "$PY" scripts/gpu_check.py summarize --out "$REPORT/steps.json" \
    "${RUN_DIRS[@]}"

# ---- 5. the default one-epoch run
if wanted epoch; then
    step default-epoch 150 "${LAUNCH[@]}" --config_file configs/accelerate/single_gpu_bf16.yaml train.py \
        "output_dir=$RUNS/default_epoch" ${EPOCH[@]+"${EPOCH[@]}"} "${NO_WANDB[@]}"
    step default-epoch-summary 60 "$PY" scripts/gpu_check.py summarize --out "$REPORT/default_epoch.json" \
        "$RUNS/default_epoch"
    cp "$RUNS/default_epoch/summary.json" "$REPORT/default_epoch_summary.json" 2>/dev/null
    cp "$RUNS/default_epoch/metrics.jsonl" "$REPORT/default_epoch_metrics.jsonl" 2>/dev/null
    publish
fi

# ---- 6. the full bench, with what time is left
wanted bench && step bench 600 "$PY" scripts/bench.py "${BENCH[@]}" --out "$REPORT/bench.json"

echo "report: $DEST/gpu_check_report.tar.gz (summary.txt beside it); checkpoints in $RUNS"
cat "$SUMMARY"
exit $FAILED
