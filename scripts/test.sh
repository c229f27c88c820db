#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the default test suite (slow tests excluded).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests benchmarks
.venv/bin/python -m pytest -q -m "not slow" "$@"
