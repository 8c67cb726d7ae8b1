#!/usr/bin/env bash
# Creates .venv and installs cliptk with its dev extras. Idempotent: a second run with nothing to
# do finishes in about a second (it compares a stamp of pyproject.toml + this script) and prints one line.
# A run with work to do says each step as it starts, and pip's own lines show what it fetches and installs
# (a quiet pip printed nothing for about 4 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
VENV=${VENV:-.venv}
stamp="$VENV/.cliptk-setup-stamp"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -x "$VENV/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  echo "setup: $VENV is up to date"
  exit 0
fi
start=$SECONDS
step() { echo "setup: [$1/3] $2 ($((SECONDS - start)) s)"; }
if [ -x "$VENV/bin/python" ]; then
  step 1 "$VENV exists; updating it"
else
  step 1 "creating the virtual environment $VENV with $PY"
  "$PY" -m venv "$VENV"
fi
export NO_ALBUMENTATIONS_UPDATE=1
pip_install() { "$VENV/bin/python" -m pip install --disable-pip-version-check "$@"; }
# torch and torchvision pinned in the same resolution: an unpinned open_clip_torch would otherwise pull
# a different torch, and PyPI's torchvision only imports beside the torch it was built for (0.29.1 <-> 2.14.1).
step 2 "installing cliptk[dev] with torch 2.14.1 and torchvision 0.29.1 (a few minutes on 2 cores; pip's lines follow)"
pip_install -e ".[dev]" "torch==2.14.1" "torchvision==0.29.1"
step 3 "checking the installed packages (pip check)"
"$VENV/bin/python" -m pip check
echo "$want" > "$stamp"
echo "setup: $VENV ready in $((SECONDS - start)) s"
