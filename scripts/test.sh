#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the checks: ruff lint, ruff format, and the default test suite (slow tests
# excluded) in a random order (pytest-randomly prints the seed; rerun an order with --randomly-seed=N).
# VITLAB_TEST_THREADS=1 runs the suite with one torch thread.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check src tests benchmarks
.venv/bin/python -m pytest -q -m "not slow" "$@"
