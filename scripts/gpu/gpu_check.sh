#!/usr/bin/env bash
# One prepared check of NormLab's GPU paths on a machine with one NVIDIA GPU and no package registry (docs/gpu.md
# has the device call that runs it, where each section's time estimate comes from, and what to do with the result):
#
#   bash scripts/gpu/gpu_check.sh [--cpu] [--plan]
#
# Before: python scripts/gpu/gpu_prepare.py (where pip reaches a registry) puts the wheels the GPU image lacks in .whl/
# and SST-2 and the source record (the commit) in .gpudata/; this script installs the wheels into its work folder
# and points train.py at the data. Sections, most important first, so a check cut short still returns what matters:
#   wheels, environment   the carried wheels installed; versions, the GPU, the commit (logs/environment.log)
#   triton        tests/test_triton_layer_norm.py without the interpreter tests (CI runs those): the sm_90 compile
#                 and, on a GPU, the compiled kernels against torch
#   kernels       gpu_check.py kernels: the Triton backend registered and launched; fp32/bf16/fp16 at 128-8192
#                 columns against float64; a fully padded sequence under bf16/fp16 autocast stays finite
#   steps-*       30 steps each under bf16, fp16, DDP and FSDP (one process each), then steps-summary
#   ln-bench      scripts/gpu/ln_bench.py: Triton vs torch LayerNorm, bandwidth against a copy, errors against float64
#   default-epoch the default run, one epoch of SST-2 (bf16): wall time, tokens/s, accuracy; then its summary
#   bench         scripts/bench.py --device cuda, eager
# Where results go: a work folder ($GPU_CHECK_WORK, default a new /tmp/gpu_check.XXXXXX) holds report/ (small
# files: logs, JSON) and runs/ (checkpoints, never returned). After every section report/ is packed into
# $DEST/gpu_check_report.tar.gz and summary.txt is copied beside it: DEST is $GPU_CHECK_DEST, else the device's
# returned folder $OUT, else runs/gpu_check-<time>. Two files: the device returns at most eight. summary.txt's first
# line names the commit checked (scripts/gpu/gpu_prepare.py --source).
# Time: every section runs under `timeout -k` (scripts/gpu/run_section.sh, which then kills whatever it left running)
# within its own limit and what is left of $GPU_CHECK_BUDGET_S (default
# 480 s, counted from the start; --cpu 1800); a section not started for lack of time is reported as such. Exit code
# 0 only when every section passed. --plan prints each section's estimate (s), limit (s) and command, and runs none.
# Python: $PYTHON, default python3 (the image's; it has no `python`).
# --cpu: the same sections, tiny and on the CPU (tests/test_gpu_check.py rehearses the check with it); fp16, DDP and
#        FSDP steps are GPU-only (accelerate refuses them on a CPU; tests/test_precision.py covers them there).
# GPU_CHECK_SECTIONS="wheels environment triton kernels steps ln-bench epoch bench" (the default) selects sections.
set -uo pipefail
cd "$(dirname "$0")/../.."

CPU=0 PLAN=0
for arg in "$@"; do
    case $arg in
        --cpu) CPU=1 ;;
        --plan) PLAN=1 ;;
        *) echo "error: unknown argument $arg (valid: --cpu, --plan)" >&2; exit 2 ;;
    esac
done
PY=${PYTHON:-python3}
WHEELS=${GPU_CHECK_WHEELS:-.whl}
DATA=${GPU_CHECK_DATA:-.gpudata}
BUDGET=${GPU_CHECK_BUDGET_S:-480}
SCALE=1  # --cpu: every limit 5 times longer (a small, shared CPU; the budget too, unless set)
if [ $CPU = 1 ]; then SCALE=5; BUDGET=${GPU_CHECK_BUDGET_S:-1800}; fi
SECTIONS=" ${GPU_CHECK_SECTIONS:-wheels environment triton kernels steps ln-bench epoch bench} "
wanted() { [[ "$SECTIONS" == *" $1 "* ]]; }
FAILED=0

if [ $PLAN = 0 ]; then
    DEST=${GPU_CHECK_DEST:-${OUT:-runs/gpu_check-$(date +%Y%m%d-%H%M%S)}}
    WORK=${GPU_CHECK_WORK:-$(mktemp -d /tmp/gpu_check.XXXXXX)}
    REPORT=$WORK/report
    RUNS=$WORK/runs
    mkdir -p "$DEST" "$REPORT/logs" "$RUNS"
    SUMMARY="$REPORT/summary.txt"
    SOURCE=$(timeout -k 5 30 "$PY" scripts/gpu/gpu_prepare.py --source "$DATA" 2>/dev/null | tail -1)
    export GPU_CHECK_SOURCE=${SOURCE:-commit unknown (scripts/gpu/gpu_prepare.py --source failed)}
    echo "source: $GPU_CHECK_SOURCE" | tee "$SUMMARY"
else
    WORK=/tmp/gpu_check.plan REPORT=$WORK/report RUNS=$WORK/runs
fi

# publish: the report so far, packed into DEST (what the device returns even if the check is killed later)
publish() {
    cp "$SUMMARY" "$DEST/summary.txt"
    tar -czf "$DEST/gpu_check_report.tar.gz.part" -C "$WORK" report && \
        mv "$DEST/gpu_check_report.tar.gz.part" "$DEST/gpu_check_report.tar.gz"
}

# step NAME ESTIMATE_S LIMIT_S CMD...: run within its limit and what is left of the budget (run_section.sh: under
# `timeout -k`, then whatever it left running killed, torchrun's workers too), log to report/logs/NAME.log, record
# ok/FAIL in summary.txt, publish. ESTIMATE_S: the expected time on an H200 (docs/gpu.md); --plan prints it.
step() {
    local name=$1 estimate=$2 limit=$(($3 * SCALE)); shift 3
    if [ $PLAN = 1 ]; then printf '%s\t%s\t%s\t%s\n' "$name" "$estimate" "$limit" "${*@Q}"; return; fi
    local t0=$SECONDS left=$((BUDGET - SECONDS))
    if [ $left -lt 10 ]; then
        printf '%-34s %s\n' "$name" "FAIL (not run: the ${BUDGET}s budget is spent)" | tee -a "$SUMMARY"
        FAILED=1; publish; return
    fi
    [ "$limit" -gt $left ] && limit=$left
    echo "== $name: $*"
    bash scripts/gpu/run_section.sh "$limit" "$@" > "$REPORT/logs/$name.log" 2>&1
    local rc=$?
    local status=ok
    if [ $rc -ne 0 ]; then
        status="FAIL (exit $rc$([ $rc -eq 124 ] || [ $rc -eq 137 ] && echo ", timed out after ${limit}s"))"
        FAILED=1
    fi
    printf '%-34s %-40s %4ds\n' "$name" "$status" $((SECONDS - t0)) | tee -a "$SUMMARY"
    [ "$status" = ok ] || tail -5 "$REPORT/logs/$name.log"
    publish
}

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled PYTHONUNBUFFERED=1
if [ -z "${NORMLAB_DATA_DIR:-}" ] && [ -d "$DATA/sst2" ]; then export NORMLAB_DATA_DIR=$PWD/$DATA; fi
export NORMLAB_CACHE=${NORMLAB_CACHE:-$WORK/cache}

# ---- the carried wheels, then the environment
CARRIED=("$WHEELS"/*.whl)
[ -e "${CARRIED[0]}" ] || CARRIED=()
if { [ ${#CARRIED[@]} -gt 0 ] || [ $PLAN = 1 ]; } && wanted wheels; then
    step wheels 10 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$WORK/site" "${CARRIED[@]}"
    export PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}
fi
# nothing of NormLab is pip-installed on the image: its packages (model/, normlab/, ...) are imported from here
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
wanted environment && step environment 10 60 "$PY" scripts/gpu/gpu_check.py environment ${CARRIED[@]+"${CARRIED[@]}"}
[ $PLAN = 0 ] && wanted environment && cat "$REPORT/logs/environment.log"

if [ $CPU = 1 ]; then
    DEVICE=cpu STEPS=2
    TINY=(model.hidden_size=32 model.num_hidden_layers=2 model.num_attention_heads=2 model.intermediate_size=64
          model.vocab_size=1000 data.max_train_samples=200 data.max_eval_samples=64 train.batch_size=16
          train.warmup_steps=1 train.cpu_threads=1)
    EPOCH=("${TINY[@]}" train.max_steps=4)
    COLUMNS=(128 1000)
    LN_BENCH=(--device cpu --quick --no-compile)
    BENCH=(--device cpu --quick --no-compile --repeats 1 --batches 1)
    LAUNCHES=(single_gpu_bf16:powernorm)
else
    DEVICE=cuda STEPS=30 EPOCH=()
    TINY=(data.max_train_samples=960 data.max_eval_samples=256)  # 30 batches of 32: no time on unused rows
    COLUMNS=(128 1000 4096 8192)
    LN_BENCH=(--device cuda)
    BENCH=(--device cuda --no-compile --repeats 3 --batches 6)
    # the BN family where its float32 statistics matter (bf16, DDP, FSDP: PowerNorm once crashed there), the
    # default model under fp16's loss scaling; the default under bf16 is the epoch below
    LAUNCHES=(single_gpu_bf16:powernorm single_gpu_fp16:default multi_gpu:masked_batchnorm fsdp:powernorm)
fi
LAUNCH=("$PY" -m accelerate.commands.launch --num_processes 1)
NO_WANDB=(wandb.mode=disabled wandb.report_to=none)

# ---- the kernels' correctness: the Triton tests in GPU mode (no interpreter: CI runs it), then against float64
TRITON_TESTS=(tests/test_triton_layer_norm.py -k "not interpreted")
wanted triton && step triton 60 150 "$PY" -m pytest -q -p no:cacheprovider "${TRITON_TESTS[@]}"
wanted kernels && step kernels 40 120 "$PY" scripts/gpu/gpu_check.py kernels --device $DEVICE --columns "${COLUMNS[@]}" \
    --out "$REPORT/kernels.json"

# ---- a few steps of one config under each launch config
RUN_DIRS=()
wanted steps || LAUNCHES=()
for pair in ${LAUNCHES[@]+"${LAUNCHES[@]}"}; do
    launch=${pair%%:*} variant=${pair#*:}
    config=(); [ "$variant" != default ] && config=(--config "$variant")
    step "steps-$variant-$launch" 25 75 "${LAUNCH[@]}" --config_file "configs/accelerate/$launch.yaml" train.py \
        ${config[@]+"${config[@]}"} "output_dir=$RUNS/$variant-$launch" ${TINY[@]+"${TINY[@]}"} \
        "train.max_steps=$STEPS" "train.eval_steps=$STEPS" "train.save_steps=$STEPS" "${NO_WANDB[@]}"
    RUN_DIRS+=("$RUNS/$variant-$launch")
done
[ ${#RUN_DIRS[@]} -gt 0 ] && step steps-summary 5 30 "$PY" scripts/gpu/gpu_check.py summarize \
    --out "$REPORT/steps.json" "${RUN_DIRS[@]}"

# ---- the LayerNorm against the memory system
wanted ln-bench && step ln-bench 45 120 "$PY" scripts/gpu/ln_bench.py "${LN_BENCH[@]}" --out "$REPORT/ln_bench.json"

# ---- the default one-epoch run
if wanted epoch; then
    step default-epoch 75 150 "${LAUNCH[@]}" --config_file configs/accelerate/single_gpu_bf16.yaml train.py \
        "output_dir=$RUNS/default_epoch" ${EPOCH[@]+"${EPOCH[@]}"} "${NO_WANDB[@]}"
    step default-epoch-summary 5 30 "$PY" scripts/gpu/gpu_check.py summarize --out "$REPORT/default_epoch.json" \
        "$RUNS/default_epoch"
    if [ $PLAN = 0 ]; then
        cp "$RUNS/default_epoch/summary.json" "$REPORT/default_epoch_summary.json" 2>/dev/null
        cp "$RUNS/default_epoch/metrics.jsonl" "$REPORT/default_epoch_metrics.jsonl" 2>/dev/null
        publish
    fi
fi

# ---- the bench, with what time is left
wanted bench && step bench 45 600 "$PY" scripts/bench.py "${BENCH[@]}" --out "$REPORT/bench.json"

[ $PLAN = 1 ] && exit 0
echo "report: $DEST/gpu_check_report.tar.gz (summary.txt beside it); checkpoints in $RUNS"
cat "$SUMMARY"
exit $FAILED
