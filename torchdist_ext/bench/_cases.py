"""One benchmark case (collective, size) and its timing, shared by every column of the collectives table.

The tensors of a case are made once per size and shared by the columns (a 256 MB all_gather would
otherwise hold one set per column). check(col) runs one op with rank-dependent values and says
whether the result is right; run(col) is the timed op. Timing interleaves the columns over rounds,
so every column sees the same machine state, and keeps every sample for percentiles.
"""
import math
import time

import torch

__all__ = ["make_case", "percentile", "time_interleaved"]


def _pattern(count, dtype, offset=0):
    """Rank-dependent values that are exact in every benchmarked dtype (small integers)."""
    return (torch.arange(count, dtype=torch.int32) % 7 + offset).to(dtype)


def make_case(collective, nbytes, rank, n, dtype):
    """(check, run) for one size; both take a column (see _columns)."""
    count = nbytes // torch.empty((), dtype=dtype).element_size()
    if collective == "all_reduce":
        t = torch.empty(count, dtype=dtype)

        def check(col):
            t.copy_(_pattern(count, dtype, rank))
            col.all_reduce(t)
            ok = torch.equal(t, (_pattern(count, torch.int64) * n + n * (n - 1) // 2).to(dtype))
            t.zero_()  # timed iterations accumulate in place; zeros keep the values finite
            return ok

        return check, lambda col: col.all_reduce(t)
    if collective == "broadcast":
        t = torch.empty(count, dtype=dtype)

        def check(col):
            t.copy_(_pattern(count, dtype, 1)) if rank == 0 else t.zero_()
            col.broadcast(t)
            return torch.equal(t, _pattern(count, dtype, 1))

        return check, lambda col: col.broadcast(t)
    c = count // n  # elements per rank block
    if collective == "all_gather":
        inp, out = _pattern(c, dtype, 8 * rank), torch.empty(count, dtype=dtype)

        def check(col):
            out.zero_()
            col.all_gather(out, inp)
            return torch.equal(out, torch.cat([_pattern(c, dtype, 8 * p) for p in range(n)]))

        return check, lambda col: col.all_gather(out, inp)
    if collective == "reduce_scatter":
        inp, out = _pattern(count, dtype, rank), torch.empty(c, dtype=dtype)

        def check(col):
            out.zero_()
            col.reduce_scatter(out, inp)
            want = _pattern(count, torch.int64)[rank * c:(rank + 1) * c] * n + n * (n - 1) // 2
            return torch.equal(out, want.to(dtype))

        return check, lambda col: col.reduce_scatter(out, inp)
    if collective == "all_to_all":
        inp, out = _pattern(count, dtype, 8 * rank), torch.empty(count, dtype=dtype)

        def check(col):
            out.zero_()
            col.all_to_all(out, inp)
            block = slice(rank * c, (rank + 1) * c)
            return torch.equal(out, torch.cat([_pattern(count, dtype, 8 * p)[block] for p in range(n)]))

        return check, lambda col: col.all_to_all(out, inp)
    raise ValueError(f"unknown collective {collective!r}")


def percentile(samples, q):
    """The q-quantile (0..1) of `samples`, nearest rank."""
    s = sorted(samples)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def time_interleaved(run, cols, barrier, iters, warmup, rounds):
    """Per column, `iters` samples (seconds) of one synchronous op each, after `barrier()`.

    The columns take turns: `rounds` rounds, each giving every column iters/rounds samples, the
    order rotated every round so no column always runs first. Each column warms up with `warmup`
    ops in the first round and 2 in later ones.
    """
    names = list(cols)
    per_round = max(1, -(-iters // rounds))
    samples = {c: [] for c in names}
    for r in range(rounds):
        for c in names[r % len(names):] + names[:r % len(names)]:
            col = cols[c]
            for _ in range(warmup if r == 0 else min(2, warmup)):
                run(col)
            for _ in range(per_round):
                barrier()
                t0 = time.perf_counter()
                run(col)
                samples[c].append(time.perf_counter() - t0)
    return samples
