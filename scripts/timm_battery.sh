#!/usr/bin/env bash
# timm's own model tests over every vitlab model, and a real Hugging Face Trainer run.
#
# Creates a separate virtual environment (default .venv-timm/, git-ignored) with a torch + torchvision pair
# from the package registry (on Linux their CUDA builds, which run on the CPU too), timm pinned, pytest, and
# transformers; then
#   1. runs the test functions of timm's tests/test_models.py (taken from timm's source distribution of the
#      pinned version, unchanged) over vitlab's registered models, re-parametrised by
#      scripts/timm_battery/conftest.py (asserts untouched; the few by-design skips are listed there);
#   2. runs a real transformers.Trainer (4.x and 5.x) with gradient checkpointing and loads what it saved
#      with vitlab.from_pretrained (scripts/timm_battery/trainer_check.py).
# It needs the package registry and several GB of disk (torch's CUDA wheels): run it before a submission
# that touches the models; it is not part of the default CI.
#
#   scripts/timm_battery.sh                          # everything, every model
#   VITLAB_TIMM_MODELS='*_mini' scripts/timm_battery.sh -k "forward or backward"   # pytest options pass on
#   TIMM_PYTHON=/path/to/python scripts/timm_battery.sh   # use an existing environment with timm + pytest
#   TRAINER_PYTHONS="/a/python /b/python"           # environments with transformers for the Trainer run
#   SKIP_TRAINER=1                                   # timm's tests only
#   BATTERY_JOBS=1                                   # one pytest process (default: one per core, pytest-xdist)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
TIMM_VERSION=${TIMM_VERSION:-1.0.31}
TORCH_PAIR=${TORCH_PAIR:-"torch==2.13.0 torchvision==0.28.0"}
# Both from one index: pip's user configuration may add a folder of local wheels (a CPU torch) that would be
# paired with the registry's CUDA torchvision, which then fails at import ("operator torchvision::nms does not
# exist"); --isolated reads neither that nor PIP_* variables. TORCH_PIP_ARGS="" (or an --index-url) overrides.
TORCH_PIP_ARGS=${TORCH_PIP_ARGS-"--isolated --disable-pip-version-check"}
TRANSFORMERS=${TRANSFORMERS:-"transformers>=5,<6 transformers>=4.57,<5"}
VENV=${TIMM_VENV:-$ROOT/.venv-timm}

if [[ -z "${TIMM_PYTHON:-}" ]]; then
  if [[ ! -f $VENV/.installed ]]; then  # written last: an install stopped half-way is taken up again
    [[ -x $VENV/bin/python ]] || python3 -m venv "$VENV"
    "$VENV/bin/pip" $TORCH_PIP_ARGS install -q $TORCH_PAIR
    "$VENV/bin/pip" install -q "timm==$TIMM_VERSION" pytest pytest-timeout pytest-xdist safetensors pyyaml numpy pillow
    "$VENV/bin/pip" install -q --no-deps -e "$ROOT"
    touch "$VENV/.installed"
  fi
  PY=$VENV/bin/python
else
  PY=$TIMM_PYTHON
fi
"$PY" -c "import torch, torchvision, timm; print('torch', torch.__version__, 'torchvision', torchvision.__version__, 'timm', timm.__version__)"

# timm's tests from its source distribution (not committed: fetched into the git-ignored venv folder)
TESTS=$VENV/timm-$TIMM_VERSION
if [[ ! -f $TESTS/tests/test_models.py ]]; then
  mkdir -p "$TESTS"
  "$PY" -m pip download -q --no-deps --no-binary :all: "timm==$TIMM_VERSION" -d "$TESTS/sdist"
  tar -xzf "$TESTS/sdist/timm-$TIMM_VERSION.tar.gz" -C "$TESTS" --strip-components=1 "timm-$TIMM_VERSION/tests"
fi
cp scripts/timm_battery/conftest.py "$TESTS/conftest.py"
printf '[pytest]\nfilterwarnings =\n    ignore::pytest.PytestUnknownMarkWarning\n' > "$TESTS/pytest.ini"

export PYTHONPATH=$ROOT/src${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
JOBS=${BATTERY_JOBS:-$(getconf _NPROCESSORS_ONLN)}  # pytest-xdist workers, one thread each (nproc would read OMP_NUM_THREADS)
XDIST=(); if (( JOBS > 1 )); then XDIST=(-n "$JOBS"); fi
(cd "$TESTS" && "$PY" -m pytest -q -p no:cacheprovider -p no:randomly -rs "${XDIST[@]}" tests/test_models.py "$@")

# a real Trainer with each transformers line, in a venv beside the battery's (its packages seen through a .pth)
if [[ -z "${SKIP_TRAINER:-}" ]]; then
  TRAINER_PYTHONS=${TRAINER_PYTHONS:-}
  if [[ -z $TRAINER_PYTHONS ]]; then
    SITE=$("$PY" -c 'import site; print(site.getsitepackages()[0])')
    for spec in $TRANSFORMERS; do
      TVENV=$VENV-hf-${spec//[^0-9a-z]/}
      if [[ ! -f $TVENV/.installed ]]; then
        [[ -x $TVENV/bin/python ]] || "$PY" -m venv "$TVENV"
        echo "$SITE" > "$("$TVENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')/battery.pth"
        "$TVENV/bin/pip" install -q "$spec" accelerate  # torch is the battery's, seen through battery.pth
        touch "$TVENV/.installed"
      fi
      TRAINER_PYTHONS="$TRAINER_PYTHONS $TVENV/bin/python"
    done
  fi
  for tpy in $TRAINER_PYTHONS; do
    "$tpy" scripts/timm_battery/trainer_check.py
  done
fi
