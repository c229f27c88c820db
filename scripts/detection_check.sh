#!/usr/bin/env bash
# The detection tests that need torchvision, in an environment where its compiled ops load.
#
# torchvision's R-CNN machinery (RPN, RoIAlign, NMS: vitlab.tasks.detection.rcnn) needs torchvision's compiled
# ops, which do not load beside the CPU torch wheel of the main environment; there tests/test_rcnn.py skips. This
# creates a separate virtual environment (default .venv-det/, git-ignored) with a matching torch + torchvision
# pair from the package registry (on Linux their CUDA builds, which run on the CPU too), pycocotools, scipy and
# pytest; installs vitlab into it (editable, no dependencies); prints the versions; then runs tests/test_rcnn.py
# and the other detection test files there (those of DET_TESTS that exist). It needs the package registry and
# about 5 GB of disk (torch's CUDA wheels): run it before a submission that touches detection; it is not part of
# the default CI.
#
#   scripts/detection_check.sh                       # tests/test_rcnn.py and the other detection tests
#   scripts/detection_check.sh -k mask -x            # pytest options pass on
#   DET_PYTHON=/path/to/python scripts/detection_check.sh    # use an existing environment (torchvision + pytest)
#   DET_VENV=/elsewhere/.venv-det                    # where to create the environment
#   DET_TESTS="tests/test_detr.py"                   # the test files besides tests/test_rcnn.py
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
TORCH_PAIR=${TORCH_PAIR:-"torch==2.13.0 torchvision==0.28.0"}
# Both from one index: pip's user configuration may add a folder of local wheels (a CPU torch) that would be
# paired with the registry's CUDA torchvision, which then fails at import ("operator torchvision::nms does not
# exist"); --isolated reads neither that nor PIP_* variables. TORCH_PIP_ARGS="" (or an --index-url) overrides.
TORCH_PIP_ARGS=${TORCH_PIP_ARGS-"--isolated --disable-pip-version-check"}
DET_TESTS=${DET_TESTS-"tests/test_det_data.py tests/test_det_metrics.py tests/test_detr.py tests/test_det_train.py"}
VENV=${DET_VENV:-$ROOT/.venv-det}

# the studies' tables and plots need matplotlib; the marker holds this list, so a longer one installs again
PACKAGES="pycocotools scipy pytest pytest-timeout numpy pillow pyyaml safetensors matplotlib"
if [[ -z "${DET_PYTHON:-}" ]]; then
  # written last: an install stopped half-way is taken up again
  if [[ "$(cat "$VENV/.installed" 2>/dev/null)" != "$TORCH_PAIR $PACKAGES" ]]; then
    [[ -x $VENV/bin/python ]] || python3 -m venv "$VENV"
    "$VENV/bin/pip" $TORCH_PIP_ARGS install -q $TORCH_PAIR
    "$VENV/bin/pip" install -q $PACKAGES
    "$VENV/bin/pip" install -q --no-deps -e "$ROOT"
    echo "$TORCH_PAIR $PACKAGES" > "$VENV/.installed"
  fi
  PY=$VENV/bin/python
else
  PY=$DET_PYTHON
fi
"$PY" -c "
import torch, torchvision, pycocotools
from importlib.metadata import version
print('torch', torch.__version__, 'torchvision', torchvision.__version__, 'pycocotools', version('pycocotools'))
torchvision.ops.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)  # the compiled ops load: the tests will not skip
"

TESTS=(tests/test_rcnn.py)
for t in $DET_TESTS; do
  if [[ -f $t ]]; then TESTS+=("$t"); fi
done
export PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}" "$@"
