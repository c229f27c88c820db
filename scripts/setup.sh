#!/usr/bin/env bash
# Create .venv (once) and install vitlab with its test tools at the exact versions of requirements.lock
# (refresh the lock with scripts/lock.sh). torch is pinned through constraints.txt so pip takes the local
# CPU wheel instead of resolving several GB of CUDA packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -r requirements.lock
.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
