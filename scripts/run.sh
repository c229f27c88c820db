#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job on its default settings: `vitlab compare` trains the eight
# variants (DeiT, Refiner, re-attention, CPVT, TNT, EAMLP, AFT-full, AFT-conv) on the embedded MNIST and
# writes runs/compare/{table.csv,table.json,table.md,curves.png,acc_vs_speed.png}. Without arguments it runs
# with --resume: a second run reuses the finished variants (the same table) and continues an interrupted one;
# `bash scripts/run.sh --force` starts over (the old files are moved aside).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
[ $# -gt 0 ] || set -- --resume
.venv/bin/vitlab compare "$@"
