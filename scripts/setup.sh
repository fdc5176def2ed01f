#!/usr/bin/env bash
# Installs what is missing (pinned Python packages) and builds the extension for this checkout.
# Used by the README's two commands; safe to run again.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q -r requirements-dev.txt 2>&1 | grep -v "as the 'root' user" || true
here=$(realpath torchdist_ext)
installed=$(cd / && "$PY" -c "import os, torchdist_ext; print(os.path.realpath(os.path.dirname(torchdist_ext.__file__)))" 2>/dev/null || true)
if [ "$installed" != "$here" ]; then
  echo "building torchdist_ext (pip install --no-build-isolation -e .), a few minutes on 2 cores"
  "$PY" -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | grep -v "as the 'root' user" || true
else
  # Already installed from this checkout: rebuild what changed (incremental with ninja).
  "$PY" setup.py -q build_ext --inplace >/dev/null
fi
