"""One rank of a job on the test hosts (tests/_testhosts.py), started by torchrun on each host.

    python tests/_hostjob.py OUTDIR MODULE:FUNCTION [ARG ...]

Initializes the default group on tdx from torchrun's environment (timeout TDX_TEST_PG_TIMEOUT
seconds, default 60; with TDX_STORE set, through torchdist_ext.init_distributed and that store), calls FUNCTION(rank, world_size, *ARGS) from MODULE (a test module beside
this file), and saves {"host", "result"} to OUTDIR/rank<R>.pt, or the traceback to OUTDIR/rank<R>.err.
"""
import importlib
import os
import socket
import sys
import traceback
from datetime import timedelta


def main():
    out, target, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    rank = int(os.environ["RANK"])
    try:
        import torch
        import torch.distributed as dist

        import torchdist_ext  # noqa: F401  registers "tdx"

        torch.set_num_threads(1)
        module, name = target.split(":")
        fn = getattr(importlib.import_module(module), name)
        timeout = timedelta(seconds=float(os.environ.get("TDX_TEST_PG_TIMEOUT", "60")))
        if os.environ.get("TDX_STORE"):  # the store in etcd (torchdist_ext.etcd_store), as init_distributed reads it
            torchdist_ext.init_distributed("tdx", timeout=timeout)
        else:
            dist.init_process_group("tdx", timeout=timeout)
        result = fn(rank, dist.get_world_size(), *args)
        # Saved before the group is destroyed: a job that provoked a failure still reports.
        path = os.path.join(out, f"rank{rank}.pt")
        torch.save({"host": socket.gethostname(), "result": result}, path + ".tmp")
        os.replace(path + ".tmp", path)
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test through the file
        with open(os.path.join(out, f"rank{rank}.err"), "w") as f:
            f.write(f"rank {rank} on {socket.gethostname()}:\n{traceback.format_exc()}")
        sys.exit(1)


if __name__ == "__main__":
    main()
