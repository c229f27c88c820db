#!/usr/bin/env bash
# Create .venv (once) and install vitlab with its test tools. torch is pinned
# through constraints.txt so pip takes the local CPU wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[dev]"
