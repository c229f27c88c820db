#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the checks: ruff lint, ruff format, the default test suite (slow tests
# excluded) in a random order (pytest-randomly prints the seed; rerun an order with --randomly-seed=N), then the
# Triton kernels in Triton's CPU interpreter (TRITON_INTERPRET=1, every case), then the tests of the fast paths'
# choices twice more: with every fast path off (VITLAB_FAST_PATHS=0, the plain path any user can choose) and on
# an emulated CPU without AVX-512 (oneDNN's and ATen's kernels limited to AVX2, as on most laptops and many cloud
# machines; the fast paths are then decided as there).
# The runs spread their test files over one pytest-xdist worker per core (at most 4; VITLAB_TEST_WORKERS=N picks
# N, 0 runs in this process): most tests are short and single-threaded (imports, subprocesses, small tensors), so
# two workers on 2 cores take about half the time of one. VITLAB_TEST_THREADS=1 runs each worker with one torch
# thread.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
WORKERS=${VITLAB_TEST_WORKERS:-$(( $(nproc) < 4 ? $(nproc) : 4 ))}
XDIST=(-n "$WORKERS" --dist loadfile)
[ "$WORKERS" -gt 0 ] || XDIST=(-p no:xdist)
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check src tests benchmarks
.venv/bin/python -m pytest -q -m "not slow" "${XDIST[@]}" "$@"
FAST_PATH_TESTS=(tests/test_ops.py tests/test_low_precision.py tests/test_aft.py tests/test_aft_conv_core.py
    tests/test_aft_simple_fused.py tests/test_external.py tests/test_mixnorm.py tests/test_refiner.py
    tests/test_reattention.py tests/test_attention.py tests/test_inference_mode.py tests/test_models.py)
echo "== the Triton kernels in Triton's interpreter (every case, slow ones included)"
TRITON_INTERPRET=1 .venv/bin/python -m pytest -q -p no:randomly "${XDIST[@]}" tests/test_triton_*.py
echo "== the fast-path tests with every fast path off (VITLAB_FAST_PATHS=0)"
VITLAB_FAST_PATHS=0 .venv/bin/python -m pytest -q -m "not slow" -p no:randomly "${XDIST[@]}" "${FAST_PATH_TESTS[@]}"
echo "== the fast-path tests on an emulated AVX2-only CPU (oneDNN limited to AVX2)"
# (ATEN_CPU_CAPABILITY=avx2 is left out: inductor's generated code then computes NaN; compiled kernels go to a
# cache of their own, so that nothing built under the emulation is reused by a later run)
INDUCTOR_CACHE=$(mktemp -d)
trap 'rm -rf "$INDUCTOR_CACHE"' EXIT
ONEDNN_MAX_CPU_ISA=AVX2 TORCHINDUCTOR_CACHE_DIR="$INDUCTOR_CACHE" .venv/bin/python -m pytest -q -m "not slow" \
    -p no:randomly "${XDIST[@]}" tests/test_ops.py tests/test_low_precision.py tests/test_bench_mixers.py tests/test_models.py
