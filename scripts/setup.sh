#!/usr/bin/env bash
# Creates .venv and installs cliptk with its dev extras. Idempotent: a second run with nothing to
# do finishes in about a second (it compares a stamp of pyproject.toml + this script).
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
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
export NO_ALBUMENTATIONS_UPDATE=1
pip_install() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@"; }
# torch and torchvision pinned in the same resolution: an unpinned open_clip_torch would otherwise pull
# a different torch, and PyPI's torchvision only imports beside the torch it was built for (0.29.1 <-> 2.14.1).
pip_install -e ".[dev]" "torch==2.14.1" "torchvision==0.29.1"
"$VENV/bin/python" -m pip check
echo "$want" > "$stamp"
echo "setup: $VENV ready"
