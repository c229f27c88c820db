#!/usr/bin/env bash
# Refresh requirements.lock: resolve vitlab's dependencies and test tools (pyproject.toml, extra "dev") in a
# throw-away virtual environment, with torch pinned by constraints.txt, and record every exact version.
# scripts/setup.sh installs from the lock, so every machine tests against the same packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check -c constraints.txt ".[dev]"
{
  echo "# Exact versions of everything scripts/setup.sh installs (vitlab's dependencies and its test tools)."
  echo "# Made by scripts/lock.sh with $("$tmp/venv/bin/python" --version); refresh with: bash scripts/lock.sh"
  "$tmp/venv/bin/python" -m pip freeze --exclude-editable --all | grep -v -E '^(vitlab|pip|setuptools|wheel)(==| @)' \
    | sed -E 's/^torch==([0-9.]+)\+cpu$/torch==\1/'
} > requirements.lock
echo "wrote requirements.lock ($(grep -vc '^#' requirements.lock) packages)"
