"""The one spawn helper every multi-process test uses.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` fresh processes (spawn), initializes a
process group in each through a file:// rendezvous in a private temporary directory, calls
``fn(rank, world_size, *args)``, and returns the per-rank results. Any rank that raises, dies or
runs past ``timeout`` fails the test with that rank's own traceback (or exit code), and every
process is killed before returning.
"""
import contextlib
import io
import os
import queue as queue_mod
import shutil
import tempfile
import time
import traceback
from datetime import timedelta

import torch.multiprocessing as mp

DEFAULT_TIMEOUT = 180.0


class RankFailure(AssertionError):
    """One or more ranks failed; the message holds each failing rank's traceback."""


def _worker(rank, world_size, fn, args, backend, init_file, pg_timeout, results):
    try:
        import torch
        import torch.distributed as dist

        import torchdist_ext  # noqa: F401  (registers "tdx")

        torch.set_num_threads(1)
        if backend is not None:
            dist.init_process_group(
                backend,
                init_method=f"file://{init_file}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=pg_timeout),
            )
        result = fn(rank, world_size, *args)
        if backend is not None and dist.is_initialized():
            dist.destroy_process_group()
        # Tensors travel as bytes: a torch-shared tensor would die with this process.
        buf = io.BytesIO()
        torch.save(result, buf)
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - forwarded to the parent
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world_size, *args, backend="tdx", timeout=DEFAULT_TIMEOUT, pg_timeout=60.0, env=None,
              expect_failure_ranks=None, rank_env=None):
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` processes; returns results by rank.

    backend: process-group backend to initialize, or None to skip init (fn does it itself).
    env: extra environment variables for the ranks, in each child's environment from its start
        (torch reads e.g. TORCH_DISTRIBUTED_DEBUG when it is imported).
    rank_env: optional picklable (module-level) function rank -> dict of extra variables for that
        rank alone, applied after ``env`` (e.g. ``TDX_NODE_ID`` to simulate several hosts).
    expect_failure_ranks: if given, return {rank: ("ok"|"error"|"died", payload)} instead of
        raising, so tests can assert on failures they provoke.
    """
    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="tdx-test-")
    init_file = os.path.join(tmp, "rendezvous")
    results = ctx.Queue()
    env = {k: str(v) for k, v in (env or {}).items()}
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, fn, args, backend, init_file, pg_timeout, results),
                    daemon=True)
        for r in range(world_size)
    ]
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
            except queue_mod.Empty:
                for r, p in enumerate(procs):
                    if r not in outcome and p.exitcode is not None:
                        # Give its queued result a moment to arrive before calling it dead.
                        try:
                            rank, status, payload = results.get(timeout=1.0)
                            outcome[rank] = (status, payload)
                        except queue_mod.Empty:
                            outcome[r] = ("died", f"exit code {p.exitcode}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    missing = [r for r in range(world_size) if r not in outcome]
    for r in missing:
        outcome[r] = ("timeout", f"did not finish within {timeout:.0f} s")
    if expect_failure_ranks is not None:
        return {r: (st, _load(p) if st == "ok" else p) for r, (st, p) in outcome.items()}
    failed = {r: o for r, o in outcome.items() if o[0] != "ok"}
    if failed:
        parts = [f"--- rank {r}: {status} ---\n{payload}" for r, (status, payload) in sorted(failed.items())]
        raise RankFailure(f"{len(failed)} of {world_size} ranks failed:\n" + "\n".join(parts))
    return [_load(outcome[r][1]) for r in range(world_size)]


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


def _load(payload):
    import torch

    return torch.load(io.BytesIO(payload), weights_only=False)
