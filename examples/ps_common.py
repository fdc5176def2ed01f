"""What the parameter-server examples share: their launch options and the servers' summary line.

The examples run as scripts, so this file is importable from their folder.
"""
import torch.distributed as dist

import torchdist_ext
from torchdist_ext import ps


def add_ps_arguments(parser):
    """--servers, --mode, --staleness, --backend, --seed."""
    parser.add_argument("--servers", type=int, default=1, help="the first SERVERS ranks serve")
    parser.add_argument("--mode", choices=ps.MODES, default="sync")
    parser.add_argument("--staleness", type=int, default=0, help="SSP bound s (--mode ssp)")
    parser.add_argument("--backend", default=None, help="process-group backend (default: $TDX_BACKEND, else tdx)")
    parser.add_argument("--seed", type=int, default=0)


def start(args, **config):
    """Joins the job and returns (rank, world size, PSConfig from the options and ``config``)."""
    torchdist_ext.init_distributed(args.backend)
    cfg = ps.PSConfig(num_servers=args.servers, mode=args.mode, staleness=args.staleness, **config)
    return dist.get_rank(), dist.get_world_size(), cfg


def print_summary(rank, stats):
    print(f"server rank {rank}: {stats.updates} updates from {stats.pushes} pushes in {stats.seconds:.1f} s, "
          f"staleness histogram {stats.staleness}, workers finished {sorted(stats.finished)}, "
          f"lost {sorted(stats.lost)}", flush=True)
