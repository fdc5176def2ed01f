#!/usr/bin/env bash
# The main job: install and build, then train on scikit-learn's digits with 2 ranks on backend tdx.
# Extra arguments go to examples/train_ddp.py (e.g. --epochs 20 --checkpoint /tmp/digits.pt).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
NPROC=${NPROC:-2}
exec "${PYTHON:-python3}" -m torch.distributed.run --standalone --nproc-per-node="$NPROC" examples/train_ddp.py "$@"
