#!/usr/bin/env bash
# The GPU checks in one run on a CUDA machine (under 10 minutes on one H100), each step under its own time limit:
#   1. the tests that need CUDA (tests/test_cuda.py, the GPU cases of the device, AFT, external-attention and
#      data tests);
#   2. DeiT-S training at batch 256 on the GPU: fp32 (no TF32), bf16 autocast eager and compiled; images/s and
#      the share of the GPU's measured GEMM rate in the same dtype (vitlab bench);
#   3. AFT-local vs the Transformer at T = 3072 (L = 24, d = 256; the AFT paper's CIFAR-10 setting), fp32 and
#      bf16 (vitlab lm bench);
#   4. the default test suite on that machine (a suite that is green on any machine, GPU present or not).
# Runs vitlab from src/ with the python that holds a CUDA build of torch (PYTHON, default python3); writes one
# log per step and the benchmarks' JSON to OUT (default runs/gpu_check). VITLAB_SHARED, if set, is the folder
# with the reference vectors and data sets the tests read (golden/, data/). STEPS picks steps by name (default
# all: "cuda_tests bench_fp32 bench_bf16 lm_bench suite").
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
WORK=$(mktemp -d)

step() {  # step NAME SECONDS COMMAND...: the command's output in OUT/NAME.log, its last lines here
    local name=$1 limit=$2
    shift 2
    [[ " ${STEPS:-$name} " == *" $name "* ]] || return 0
    echo "== $name (at most ${limit}s)"
    timeout --kill-after 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local code=$?
    tail -n "${TAIL:-12}" "$OUT/$name.log"
    echo "== $name: exit $code"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"

TAIL=25 step cuda_tests 150 "$PY" -m pytest -q -p no:randomly -p no:cacheprovider -rs \
    tests/test_cuda.py tests/test_device.py \
    "tests/test_aft.py::test_modules_stable_in_fp32_and_under_autocast" \
    "tests/test_external.py::test_modules_stable_for_huge_logits_in_fp32_and_under_autocast" \
    "tests/test_data.py::test_transforms_on_cuda_match_cpu"

step bench_fp32 75 "$PY" -m vitlab bench deit_small_patch16_224 --device cuda --batch 256 --modes train \
    --dtypes fp32 --repeats 20 --warmup 3 --no-memory --out "$WORK/fp32"
step bench_bf16 150 "$PY" -m vitlab bench deit_small_patch16_224 --device cuda --batch 256 --modes train \
    --dtypes bf16 --compile both --repeats 20 --warmup 3 --no-memory --out "$WORK/bf16"

step lm_bench 90 "$PY" -m vitlab lm bench --device cuda --tokens 3072 --models aft_local transformer --flash \
    --dtypes fp32,bf16 --layers 24 --batch 4 --warmup 2 --repeats 5 --out "$WORK/lm"

TAIL=30 step suite "${SUITE_SECONDS:-100}" "$PY" -m pytest -q -p no:randomly -p no:cacheprovider -m "not slow" \
    -n "${SUITE_WORKERS:-8}" --ignore tests/test_cuda.py
for f in fp32/bench.json bf16/bench.json lm/lm_bench.json; do  # the figures, whole
    [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/${f%%/*}_${f##*/}"
done
rm -rf "$WORK"
