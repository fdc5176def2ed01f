"""Does torch's Gloo wake a receive whose sender dies partway through the message?

    python scripts/dev/gloo_partial_close.py [--mb 256] [--timeout 10]

Two processes on this machine, a plain torch Gloo group (no tdx): rank 0 posts a receive of --mb MB
from rank 1; rank 1 starts sending it and SIGKILLs itself at once, so its connection closes after
part of the message. Prints how rank 0's wait ended and after how long. With torch's Gloo (tcp
transport) it ends only at the group timeout ("Timed out waiting ... for recv operation"): the
transport fails the connection ("Connection closed by peer") but does not wake the buffer of a
message it has begun to read. docs/multihost.md (Failures across hosts) says what this means for tdx.
"""
import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta


def _rank(rank, path, mb, timeout):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=timeout))
    t = torch.zeros(mb << 18)  # float32: 2^18 per MB
    if rank == 0:
        work = dist.irecv(t, 1)
        dist.barrier()  # the receive is posted before rank 1 sends
        start = time.monotonic()
        try:
            work.wait()
            print(f"rank 0: received the whole message ({mb} MB) after {time.monotonic() - start:.2f} s")
        except Exception as e:  # noqa: BLE001 - what the wait ends with is the result
            first = str(e).splitlines()[0]
            print(f"rank 0: the receive raised after {time.monotonic() - start:.2f} s: {first[first.find('] ') + 2:][:120]}")
    else:
        dist.barrier()
        time.sleep(0.2)  # rank 0's notice that its receive is posted has arrived
        dist.isend(t + 1, 0)
        os.kill(os.getpid(), signal.SIGKILL)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=256, help="message size in MB (several socket buffers)")
    p.add_argument("--timeout", type=float, default=10.0, help="the group timeout, seconds")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--store", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank is not None:
        _rank(args.rank, args.store, args.mb, args.timeout)
        return
    with tempfile.TemporaryDirectory() as tmp:
        common = ["--store", os.path.join(tmp, "store"), "--mb", str(args.mb), "--timeout", str(args.timeout)]
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), *common]) for r in (0, 1)]
        procs[0].wait(timeout=args.timeout + 60)
        procs[1].wait(timeout=10)
    print(f"rank 1 ended with {procs[1].returncode} (-9: SIGKILL)")


if __name__ == "__main__":
    main()
