#!/usr/bin/env bash
# One node, NPROC processes (default: one per core), backend tdx.
#   bash launch/torchrun_single_node.sh examples/train_ddp.py --epochs 20
set -euo pipefail
NPROC=${NPROC:-$(nproc)}
exec python3 -m torch.distributed.run --standalone --nproc-per-node="$NPROC" "$@"
