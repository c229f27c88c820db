#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job on its default settings: `vitlab compare` trains the eight
# variants (DeiT, Refiner, re-attention, CPVT, TNT, EAMLP, AFT-full, AFT-conv) on the embedded MNIST and
# writes runs/compare/{table.csv,table.json,table.md,curves.png,acc_vs_speed.png}. A second run into the same
# folder needs --resume (reuse finished variants) or --force (start over; the old files are moved aside).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/vitlab compare "$@"
