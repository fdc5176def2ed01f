"""The one spawn helper every multi-process test uses.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` fresh processes (spawn), initializes a
process group in each through a file:// rendezvous in a private temporary directory, calls
``fn(rank, world_size, *args)``, and returns the per-rank results. Any rank that raises, dies or
runs past ``timeout`` fails the test with that rank's own traceback (or exit code), and every
process is killed before returning. The spawning itself is the package's
(``torchdist_ext._spawn.spawn_ranks``, which the benchmarks use too); this adds the test's verdict.
"""
from torchdist_ext._spawn import spawn_ranks

DEFAULT_TIMEOUT = 180.0


class RankFailure(AssertionError):
    """One or more ranks failed; the message holds each failing rank's traceback."""


def run_ranks(fn, world_size, *args, backend="tdx", timeout=DEFAULT_TIMEOUT, pg_timeout=60.0, env=None,
              expect_failure_ranks=None, rank_env=None):
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` processes; returns results by rank.

    backend: process-group backend to initialize, or None to skip init (fn does it itself).
    env: extra environment variables for the ranks, in each child's environment from its start
        (torch reads e.g. TORCH_DISTRIBUTED_DEBUG when it is imported).
    rank_env: optional picklable (module-level) function rank -> dict of extra variables for that
        rank alone, applied after ``env`` (e.g. ``TDX_NODE_ID`` to simulate several hosts).
    expect_failure_ranks: if given, return {rank: ("ok"|"error"|"died"|"timeout", payload)} instead
        of raising, so tests can assert on failures they provoke.
    """
    outcome = spawn_ranks(fn, world_size, *args, backend=backend, timeout=timeout, pg_timeout=pg_timeout, env=env,
                          rank_env=rank_env)
    if expect_failure_ranks is not None:
        return outcome
    failed = {r: o for r, o in outcome.items() if o[0] != "ok"}
    if failed:
        parts = [f"--- rank {r}: {status} ---\n{payload}" for r, (status, payload) in sorted(failed.items())]
        raise RankFailure(f"{len(failed)} of {world_size} ranks failed:\n" + "\n".join(parts))
    return [outcome[r][1] for r in range(world_size)]
