"""Runs a function on a process group of freshly spawned local processes, for the benchmarks (and
the tests, through tests/_dist.py).

``spawn_ranks(fn, world_size, *args)`` starts ``world_size`` processes (spawn), initializes a
process group in each through a file:// rendezvous in a private temporary directory, calls
``fn(rank, world_size, *args)`` and returns ``{rank: (status, value)}``: ``("ok", return value)``,
``("error", traceback)``, ``("died", "exit code N")`` for a rank that ended without a word (it may
kill itself on purpose), or ``("timeout", ...)`` for one still running after ``timeout`` seconds.
Every process is gone on return.
"""
import contextlib
import io
import os
import queue
import shutil
import tempfile
import time
import traceback
from datetime import timedelta

__all__ = ["spawn_ranks"]


def _rank_main(rank, world_size, fn, args, backend, init_file, pg_timeout, results):
    try:
        import torch
        import torch.distributed as dist

        import torchdist_ext  # noqa: F401  (registers "tdx")

        torch.set_num_threads(1)
        if backend is not None:
            dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                    timeout=timedelta(seconds=pg_timeout))
        value = fn(rank, world_size, *args)
        if backend is not None and dist.is_initialized():
            dist.destroy_process_group()
        # Tensors travel as bytes: a torch-shared tensor would die with this process.
        buf = io.BytesIO()
        torch.save(value, buf)
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - forwarded to the parent, which may expect a rank to fail
        results.put((rank, "error", traceback.format_exc()))


def spawn_ranks(fn, world_size, *args, backend="tdx", timeout=600.0, pg_timeout=60.0, env=None, rank_env=None):
    """See the module docstring.

    backend: process-group backend to initialize, or None to skip init (``fn`` does it itself).
    env: extra environment variables for the ranks, in each one's environment from its start
        (torch reads some, e.g. TORCH_DISTRIBUTED_DEBUG, when it is imported).
    rank_env: optional picklable (module-level) function rank -> dict of extra variables for that
        rank alone, applied after ``env`` (e.g. ``TDX_NODE_ID`` to simulate several hosts).
    """
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="tdx-spawn-")
    init_file = os.path.join(tmp, "rendezvous")
    results = ctx.Queue()
    env = {k: str(v) for k, v in (env or {}).items()}
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, fn, args, backend, init_file, pg_timeout, results),
                         daemon=True) for r in range(world_size)]
    for r, p in enumerate(procs):
        extra = dict(env)
        if rank_env is not None:
            extra.update({k: str(v) for k, v in rank_env(r).items()})
        with _environ(extra):  # in the child's environment before Python (and torch) starts
            p.start()
    outcome = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcome) < world_size and time.monotonic() < deadline:
            try:
                rank, status, payload = results.get(timeout=0.2)
                outcome[rank] = (status, payload)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in outcome and p.exitcode is not None:
                        # Give its queued result a moment to arrive before calling it dead.
                        try:
                            rank, status, payload = results.get(timeout=1.0)
                            outcome[rank] = (status, payload)
                        except queue.Empty:
                            outcome[r] = ("died", f"exit code {p.exitcode}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    for r in range(world_size):
        outcome.setdefault(r, ("timeout", f"did not finish within {timeout:.0f} s"))
    return {r: (status, torch.load(io.BytesIO(payload), weights_only=False) if status == "ok" else payload)
            for r, (status, payload) in sorted(outcome.items())}


@contextlib.contextmanager
def _environ(extra):
    """Sets ``extra`` in this process's environment for the block, then restores what was there."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
