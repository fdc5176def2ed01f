"""Benchmarks of torchdist_ext against its anchors, each measured side by side in one run.

    python -m torchdist_ext.bench collectives --collective all_reduce --world-size 2   # tdx vs gloo
    python -m torchdist_ext.bench ddp --world-size 2 --bucket-mb 1,5,25                # ours vs torch's DDP
    python -m torchdist_ext.bench fsdp --world-size 2                                  # ours vs torch's FSDP2
    python -m torchdist_ext.bench pipeline --world-size 2                              # ours vs torch's pipelining
    python -m torchdist_ext.bench pipeline-zb --world-size 2 --plot zb.png             # zero-bubble: ours vs torch's
    python -m torchdist_ext.bench hosts --hosts 2 --link 1gbit                          # tdx vs gloo across test hosts
    torchrun --standalone --nproc-per-node=2 -m torchdist_ext.bench tp                 # ours vs torch's DTensor TP
    python -m torchdist_ext.bench ps --world-size 4 --plot ps.png                      # parameter servers vs DDP
    python -m torchdist_ext.bench ps-replicas --world-size 4 --servers 2               # what a shard replica costs
    python -m torchdist_ext.bench elastic ddp|restart|overhead|fsdp|pipeline            # what a failure costs
    python -m torchdist_ext.bench recovery --plot recovery.png                          # a host lost and back: ours, torchft, torchrun
    python -m torchdist_ext.bench plan --world-size 4 --nproc-per-node 2 --link 10gbit  # what tdx will run, by size

``tdx-bench`` is the same command. Without a subcommand the arguments are the collectives
benchmark's (``python -m torchdist_ext.bench --collective all_reduce ...``). Results and method:
docs/performance.md.
"""
import importlib
import sys

__all__ = ["main", "COMMANDS"]

COMMANDS = {
    "collectives": "torchdist_ext.bench.collectives",
    "ddp": "torchdist_ext.bench.ddp",
    "fsdp": "torchdist_ext.bench.fsdp",
    "pipeline": "torchdist_ext.bench.pipeline",
    "pipeline-zb": "torchdist_ext.bench.pipeline_zb",
    "hosts": "torchdist_ext.bench.hosts",
    "tp": "torchdist_ext.bench.tp",
    "ps": "torchdist_ext.bench.ps",
    "ps-replicas": "torchdist_ext.bench.ps_replicas",
    "elastic": "torchdist_ext.bench.elastic",
    "recovery": "torchdist_ext.bench.recovery",
    "plan": "torchdist_ext.bench.plan",
}


def main(argv=None):
    """Runs the benchmark named by the first argument (a key of ``COMMANDS``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return None
    if argv and argv[0] in COMMANDS:
        name, argv = argv[0], argv[1:]
    elif argv and not argv[0].startswith("-"):
        raise SystemExit(f"python -m torchdist_ext.bench: unknown benchmark {argv[0]!r}; "
                         f"use one of {', '.join(COMMANDS)}")
    else:
        name = "collectives"
    return importlib.import_module(COMMANDS[name]).main(argv)
