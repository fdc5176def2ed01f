#!/usr/bin/env bash
# Several nodes with torchrun's c10d rendezvous. Run the same command on every node:
#   NNODES=2 NPROC=8 RDZV_HOST=node0.example RDZV_PORT=29400 \
#     bash launch/torchrun_multi_node.sh examples/train_ddp.py --epochs 20
# tdx groups the ranks by host (hostname, or TDX_NODE_ID where set) and runs hierarchically:
# shared memory inside a node, torch's Gloo between nodes (pick its interface with
# GLOO_SOCKET_IFNAME). MAX_RESTARTS > 0 makes the job elastic (the script must resume from a
# checkpoint); torchrun then needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, set below
# (pytorch/pytorch#135712). On SLURM use launch/slurm.sbatch instead.
set -euo pipefail
: "${RDZV_HOST:?set RDZV_HOST to a host every node can reach (it serves the rendezvous)}"
NNODES=${NNODES:?set NNODES to the number of nodes}
NPROC=${NPROC:-$(nproc)}
RDZV_PORT=${RDZV_PORT:-29400}
JOB_ID=${JOB_ID:-tdx-job}
MAX_RESTARTS=${MAX_RESTARTS:-0}
if [ "$MAX_RESTARTS" != 0 ]; then export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}; fi
exec python3 -m torch.distributed.run --nnodes="$NNODES" --nproc-per-node="$NPROC" \
  --rdzv-backend=c10d --rdzv-endpoint="$RDZV_HOST:$RDZV_PORT" --rdzv-id="$JOB_ID" \
  --max-restarts="$MAX_RESTARTS" "$@"
