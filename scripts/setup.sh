#!/usr/bin/env bash
# Installs what is missing (pinned Python packages) and builds the extension for this checkout.
# Used by the README's two commands; safe to run again.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
# pip's output without its warning about running as root; a failing pip stops the script.
quiet_pip() {
  local out
  if ! out=$("$PY" -m pip "$@" 2>&1); then
    echo "$out" >&2
    echo "setup.sh: pip $* failed" >&2
    exit 1
  fi
  echo "$out" | grep -v "as the 'root' user" || true
}
quiet_pip install -q -r requirements-dev.txt
here=$(realpath torchdist_ext)
installed=$(cd / && "$PY" -c "import os, torchdist_ext; print(os.path.realpath(os.path.dirname(torchdist_ext.__file__)))" 2>/dev/null || true)
if [ "$installed" != "$here" ]; then
  echo "building torchdist_ext (pip install --no-build-isolation -e .), a few minutes on 2 cores"
  quiet_pip install -q --no-build-isolation --no-deps -e .
else
  # Already installed from this checkout: rebuild what changed (incremental with ninja).
  "$PY" setup.py -q build_ext --inplace >/dev/null
fi
