#!/usr/bin/env bash
# Several nodes with torchrun's c10d rendezvous. Run the same command on every node:
#   NNODES=2 NPROC=8 RDZV_HOST=node0.example RDZV_PORT=29400 \
#     bash launch/torchrun_multi_node.sh examples/train_ddp.py --backend gloo
# A tdx process group must stay within one host for now (its multi-host mode is not built yet),
# so a job spanning nodes passes --backend gloo, or uses tdx for per-node subgroups.
set -euo pipefail
: "${RDZV_HOST:?set RDZV_HOST to a host every node can reach (it serves the rendezvous)}"
NNODES=${NNODES:?set NNODES to the number of nodes}
NPROC=${NPROC:-$(nproc)}
RDZV_PORT=${RDZV_PORT:-29400}
JOB_ID=${JOB_ID:-tdx-job}
exec python3 -m torch.distributed.run --nnodes="$NNODES" --nproc-per-node="$NPROC" \
  --rdzv-backend=c10d --rdzv-endpoint="$RDZV_HOST:$RDZV_PORT" --rdzv-id="$JOB_ID" "$@"
