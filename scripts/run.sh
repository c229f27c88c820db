#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job on its default settings.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/vitlab compare "$@"
