"""Soak: thousands of mixed operations and sizes with random per-rank delays, every result checked.

Not in the default run (pyproject's addopts deselect the marker). Run it with:
    python -m pytest -m soak tests/test_soak.py
Each world size runs for SOAK_SECONDS (env TDX_SOAK_SECONDS, default 60).
"""
import os
import random
import time

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks

SOAK_SECONDS = float(os.environ.get("TDX_SOAK_SECONDS", "60"))
SIZES = [0, 1, 7, 64, 1000, 4096, 16411, 65536, 300001, 1 << 20]
OPS = ["all_reduce", "reduce", "broadcast", "all_gather", "gather", "scatter", "reduce_scatter", "all_to_all",
       "barrier", "sendrecv", "all_reduce_async"]


def _value(rank, i, n, dtype):
    # Small integers: exact in every dtype and in any summation order.
    return ((torch.arange(n, dtype=torch.int64) * 7 + rank * 13 + i) % 17).to(dtype)


def _one(i, op, n, dtype, rank, ws, rng):
    root = rng.randrange(ws)
    ref = [_value(r, i, n, dtype) for r in range(ws)]
    if op in ("all_reduce", "all_reduce_async", "reduce"):
        t = ref[rank].clone()
        if op == "reduce":
            dist.reduce(t, dst=root)
            if rank != root:
                return
        elif op == "all_reduce_async":
            dist.all_reduce(t, async_op=True).wait()
        else:
            dist.all_reduce(t)
        expect = torch.stack([x.to(torch.float64) for x in ref]).sum(0).to(dtype)
        assert torch.equal(t, expect), (i, op, n, dtype)
    elif op == "broadcast":
        t = ref[rank].clone()
        dist.broadcast(t, src=root)
        assert torch.equal(t, ref[root]), (i, op, n)
    elif op == "all_gather":
        outs = [torch.empty(n, dtype=dtype) for _ in range(ws)]
        dist.all_gather(outs, ref[rank])
        assert all(torch.equal(a, b) for a, b in zip(outs, ref)), (i, op, n)
    elif op == "gather":
        outs = [torch.empty(n, dtype=dtype) for _ in range(ws)] if rank == root else None
        dist.gather(ref[rank], outs, dst=root)
        if rank == root:
            assert all(torch.equal(a, b) for a, b in zip(outs, ref)), (i, op, n)
    elif op == "scatter":
        out = torch.empty(n, dtype=dtype)
        dist.scatter(out, [ref[p] + 0 for p in range(ws)] if rank == root else None, src=root)
        assert torch.equal(out, ref[rank]), (i, op, n)
    elif op == "reduce_scatter":
        out = torch.empty(n, dtype=dtype)
        dist.reduce_scatter(out, [_value(rank, i + p, n, dtype) for p in range(ws)])
        expect = torch.stack([_value(r, i + rank, n, dtype).to(torch.float64) for r in range(ws)]).sum(0).to(dtype)
        assert torch.equal(out, expect), (i, op, n)
    elif op == "all_to_all":
        # Uneven splits, the same on every rank's view: rank p sends (p + q + i) % 5 rows to q.
        send = [(rank + q + i) % 5 for q in range(ws)]
        recv = [(p + rank + i) % 5 for p in range(ws)]
        inp = torch.cat([torch.full((s,), rank * 100 + q, dtype=torch.int64) for q, s in enumerate(send)])
        out = torch.empty(sum(recv), dtype=torch.int64)
        dist.all_to_all_single(out, inp, output_split_sizes=recv, input_split_sizes=send)
        expect = torch.cat([torch.full((s,), p * 100 + rank, dtype=torch.int64) for p, s in enumerate(recv)])
        assert torch.equal(out, expect), (i, op)
    elif op == "barrier":
        dist.barrier()
    elif op == "sendrecv":
        # A ring exchange: every rank sends to the next and receives from the previous.
        nxt, prv = (rank + 1) % ws, (rank - 1) % ws
        out = torch.empty(n, dtype=dtype)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, ref[rank], nxt), dist.P2POp(dist.irecv, out, prv)])
        for r in reqs:
            r.wait()
        assert torch.equal(out, ref[prv]), (i, op, n)


def _soak_body(rank, ws, seconds, seed):
    shared = random.Random(seed)          # the same schedule on every rank
    local = random.Random(seed * 31 + rank)  # per-rank delays
    deadline = time.monotonic() + seconds
    done = 0
    while True:
        # Agree on stopping: rank 0's clock decides, through a collective.
        if done % 50 == 0:
            flag = torch.tensor([1 if time.monotonic() < deadline else 0])
            dist.broadcast(flag, src=0)
            if flag.item() == 0:
                break
        op = shared.choice(OPS)
        n = shared.choice(SIZES)
        dtype = shared.choice([torch.float32, torch.float64, torch.int32, torch.bfloat16, torch.int64])
        if op == "sendrecv" and ws == 1:
            op = "barrier"
        if local.random() < 0.2:
            time.sleep(local.random() * 0.003)
        _one(done, op, n, dtype, rank, ws, shared)
        done += 1
    return done


@pytest.mark.soak
@pytest.mark.parametrize("ws", [2, 3, 4])
def test_soak(ws):
    counts = run_ranks(_soak_body, ws, SOAK_SECONDS, 1234 + ws, timeout=SOAK_SECONDS + 240, pg_timeout=120.0)
    assert len(set(counts)) == 1 and counts[0] >= 5 * SOAK_SECONDS, counts
    print(f"world size {ws}: {counts[0]} operations checked")
