#!/usr/bin/env bash
# Everything a lent GPU machine is for: the `gpu` tests, then the GPU benchmarks, as stages.
# Each stage has its own time limit and log, so a stage that fails or overruns leaves the others'.
#
#   bash benchmarks/gpu_session.sh SOURCE_DIR OUT_DIR [STAGE...]
#
# STAGE: sweep, tests, decode, profile, kernels, engine (default: all, in that order); the random-weight
# models they need are made first, once per machine. `sweep` times the LoRA kernels' launch shapes,
# keeps the best for this GPU (sgmv_kernels/tuned/, copied to OUT_DIR to be committed) and writes
# the kernel table with them, so the stages after it launch with them. A lease's command runs at
# most 10 minutes, so a session runs the stages over two calls on the warm machine, for example
# `sweep tests decode` then `profile engine`.
# SOURCE_DIR: the default model's config.json and tokenizer files (its 94 MB of weights need not
# travel: random weights of its shapes are made there). OUT_DIR gets versions.txt, one log per
# stage and gpu.md (the sections to merge into docs/benchmarks/gpu.md).
# The engine imports llguidance and pytest's settings name sqlalchemy: on a GPU machine without them,
# install their wheels first (pip install --target DIR) and put DIR on PYTHONPATH.
set -u
SOURCE=$1
OUT=$2
shift 2
STAGES=${*:-sweep tests decode profile kernels engine}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
PY=${PYTHON:-python3}
SMOLLM2=/tmp/smollm2-random
LLAMA8B=/tmp/llama3-8b

stage() {  # stage NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    echo "$name: exit $? in $((SECONDS - start)) s" | tee -a "$OUT/stages.txt"
    tail -n 4 "$OUT/$name.log"
}

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} >"$OUT/versions.txt" 2>&1
cat "$OUT/versions.txt"

[ -f $LLAMA8B/config.json ] || stage models 45 bash -c "$PY -m benchmarks.random_model '$SOURCE' $SMOLLM2 &&
    $PY -m benchmarks.random_model '$SOURCE' $LLAMA8B --shapes llama3-8b"
for name in $STAGES; do
    case $name in
    tests) stage tests 120 env LORASERVE_TEST_MODEL=$SMOLLM2 $PY -m pytest -m gpu -q -p no:cacheprovider \
        tests/kernels tests/correctness/test_cuda.py ;;
    decode) stage decode-llama8b 220 $PY -m benchmarks.bench_gpu --model $LLAMA8B --random-weights \
        --output "$OUT/gpu.md" ;;
    profile) stage profile-llama8b 240 $PY -m benchmarks.profile_lora_step --model $LLAMA8B --random-weights \
        --device cuda --dtype bfloat16 --pool-gib 8 --output "$OUT/gpu.md" ;;
    kernels) stage kernels 120 $PY -m benchmarks.bench_kernels --output "$OUT/gpu.md" ;;
    sweep) stage sweep 190 $PY -m benchmarks.bench_kernels --sweep --write-tuned --output "$OUT/gpu.md"
        cp sgmv_kernels/tuned/*.json "$OUT/" ;;
    engine) stage engine-llama8b 110 $PY -m benchmarks.bench_engine --model $LLAMA8B --random-weights \
        --device cuda --dtypes bfloat16 --batch-sizes 1 8 64 --repeats 1 --min-output 32 --max-output 64 \
        --output "$OUT/gpu.md" ;;
    *) echo "unknown stage $name (sweep, tests, decode, profile, kernels, engine)" >&2 ;;
    esac
done
