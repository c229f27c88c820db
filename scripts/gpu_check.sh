#!/usr/bin/env bash
# The GPU checks in one run on a CUDA machine (under 10 minutes on one H100), each step under its own time limit:
#   1. the tests that need CUDA (tests/test_cuda.py, the GPU cases of the device, AFT, external-attention and
#      data tests);
#   2. DeiT-S training at batch 256 on the GPU: fp32 (no TF32), bf16 autocast eager and compiled; images/s and
#      the share of the GPU's measured GEMM rate in the same dtype (vitlab bench);
#   3. AFT-local vs the Transformer at T = 3072 (L = 24, d = 256; the AFT paper's CIFAR-10 setting), fp32 and
#      bf16 (vitlab lm bench);
#   4. the AFT family on its Triton kernels (aft_kernels): their tests on CUDA, then AFT-local-256 / AFT-simple at
#      T = 3072 (batch 8), AFT-local-32 / AFT-full at T = 1024 (batch 32) against the SDPA flash Transformer, and
#      AFT-full-tiny / AFT-conv-tiny against DeiT-Ti at inference (batch 256), each AFT model beside its
#      pre-kernel path; bf16, then fp32 and fp16 (and rish-16's AFT when PEERS_PYTHON names the peers' python);
#   5. the default test suite on that machine (a suite that is green on any machine, GPU present or not).
# Runs vitlab from src/ with the python that holds a CUDA build of torch (PYTHON, default python3); writes one
# log per step and the benchmarks' JSON to OUT (default runs/gpu_check). VITLAB_SHARED, if set, is the folder
# with the reference vectors and data sets the tests read (golden/, data/). STEPS picks steps by name (default
# all: "cuda_tests bench_fp32 bench_bf16 lm_bench aft_kernel_tests aft_cifar_bf16 aft_enwik8_bf16 aft_imagenet_bf16
# aft_cifar_fp32_fp16 aft_enwik8_fp32_fp16 aft_peers suite"; STEPS="aft_kernel_tests aft_cifar_bf16 ..." runs the
# AFT kernels' part alone).
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

# ---- AFT family on its Triton kernels: the kernels' tests on CUDA, then the training and inference figures
# (bf16 autocast first; fp32 with TF32 off, torch's default for matrix products, and fp16 after), each model
# beside its pre-kernel path (*_pre) and the SDPA flash Transformer of the same setting (the ratios' baseline).
# About 7 minutes on one H100 with a cold Triton cache.
aft_kernels() {
    TAIL=25 step aft_kernel_tests 120 "$PY" -m pytest -q -p no:randomly -p no:cacheprovider -rs -m "" \
        tests/test_triton_aft.py
    local lm=("$PY" -m vitlab lm bench --device cuda --layers 24 --dim 256 --warmup 2 --repeats 5 --timeout 120)
    TAIL=20 step aft_cifar_bf16 120 "${lm[@]}" --tokens 3072 --batch 8 --dtypes bf16 --baseline transformer_flash \
        --models aft_local aft_local_pre aft_simple aft_simple_pre transformer_flash --out "$WORK/aft_cifar_bf16"
    TAIL=20 step aft_enwik8_bf16 100 "${lm[@]}" --tokens 1024 --batch 32 --dtypes bf16 \
        --baseline transformer_enwik8_flash --models aft_local_32 aft_local_32_pre aft_full aft_full_pre \
        transformer_enwik8_flash --out "$WORK/aft_enwik8_bf16"
    TAIL=20 step aft_imagenet_bf16 60 "$PY" -m vitlab bench aft_full_tiny aft_conv_tiny_32_11 deit_tiny_patch16_224 \
        --device cuda --batch 256 --modes infer --dtypes bf16 --repeats 10 --warmup 2 --out "$WORK/aft_imagenet_bf16"
    TAIL=20 step aft_cifar_fp32_fp16 90 "${lm[@]}" --repeats 3 --tokens 3072 --batch 8 --dtypes fp32,fp16 \
        --baseline transformer_flash --models aft_local aft_simple transformer_flash --out "$WORK/aft_cifar_fp"
    TAIL=20 step aft_enwik8_fp32_fp16 90 "${lm[@]}" --repeats 3 --tokens 1024 --batch 32 --dtypes fp32,fp16 \
        --baseline transformer_enwik8_flash --models aft_local_32 aft_full transformer_enwik8_flash \
        --out "$WORK/aft_enwik8_fp"
    # the community AFT code on the same GPU: needs the peers' environment (../shared/peer_bench/README.md)
    if [ -n "${PEERS_PYTHON:-}" ]; then
        step aft_peers 120 "$PEERS_PYTHON" "${PEER_BENCH:-../shared/peer_bench/peer_bench.py}" --device cuda \
            --dtype bf16 --pair --rounds 2 --vitlab-src "$PWD/src" --only 'rish:*' --out "$OUT/aft_peers.json"
    fi
}
aft_kernels

TAIL=30 step suite "${SUITE_SECONDS:-100}" "$PY" -m pytest -q -p no:randomly -p no:cacheprovider -m "not slow" \
    -n "${SUITE_WORKERS:-8}" --ignore tests/test_cuda.py
for f in fp32/bench.json bf16/bench.json lm/lm_bench.json aft_cifar_bf16/lm_bench.json aft_enwik8_bf16/lm_bench.json \
    aft_imagenet_bf16/bench.json aft_cifar_fp/lm_bench.json aft_enwik8_fp/lm_bench.json; do  # the figures, whole
    [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/${f%%/*}_${f##*/}"
done
rm -rf "$WORK"
