"""Point-to-point on backend "tdx": send/recv, any-source, tags, truly asynchronous isend/irecv,
batch_isend_irecv, world sizes 2-4."""
import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from _reference import assert_bitwise_equal, make_input

WORLD_SIZES = [2, 3, 4]
BIG = 3_000_000  # 12 MB of float32: many times the 1 MiB ring


def _p2p_body(rank, ws):
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    # Blocking ring: even ranks send first, odd ranks receive first.
    for numel in (0, 1, 1000, BIG):
        x = make_input(numel, rank, numel, torch.float32)
        y = torch.empty(numel)
        if rank % 2 == 0:
            dist.send(x, nxt)
            dist.recv(y, prv)
        else:
            dist.recv(y, prv)
            dist.send(x, nxt)
        assert_bitwise_equal(y, make_input(numel, prv, numel, torch.float32), f"ring send/recv numel={numel}")
    # Symmetric large exchange with isend/irecv in the same order on every rank: needs real asynchrony.
    x = make_input(11, rank, BIG, torch.float64)
    y = torch.empty(BIG, dtype=torch.float64)
    reqs = [dist.isend(x, nxt), dist.irecv(y, prv)]
    for q in reqs:
        q.wait()
    assert_bitwise_equal(y, make_input(11, prv, BIG, torch.float64), "symmetric isend/irecv")
    # batch_isend_irecv in both directions.
    a = make_input(12, rank, 5000, torch.bfloat16)
    got_prev, got_next = torch.empty(5000, dtype=torch.bfloat16), torch.empty(5000, dtype=torch.bfloat16)
    ops = [dist.P2POp(dist.isend, a, nxt), dist.P2POp(dist.irecv, got_prev, prv)]
    if ws > 2:
        ops += [dist.P2POp(dist.isend, a, prv), dist.P2POp(dist.irecv, got_next, nxt)]
    for q in dist.batch_isend_irecv(ops):
        q.wait()
    assert_bitwise_equal(got_prev, make_input(12, prv, 5000, torch.bfloat16), "batch_isend_irecv from prev")
    if ws > 2:
        assert_bitwise_equal(got_next, make_input(12, nxt, 5000, torch.bfloat16), "batch_isend_irecv from next")
    # Tags: rank 0 sends tag 1 then tag 2; rank 1 receives tag 2 first.
    if rank == 0:
        dist.send(torch.full((300_000,), 1.0), 1, tag=1)
        dist.send(torch.full((10,), 2.0), 1, tag=2)
    elif rank == 1:
        t2, t1 = torch.empty(10), torch.empty(300_000)
        w2 = dist.irecv(t2, 0, tag=2)
        w1 = dist.irecv(t1, 0, tag=1)
        w2.wait()
        w1.wait()
        assert torch.all(t2 == 2.0) and torch.all(t1 == 1.0)
    # Receive from any source: rank 0 collects one message from every other rank.
    if rank == 0:
        seen = set()
        for _ in range(ws - 1):
            buf = torch.empty(4, dtype=torch.int64)
            src = dist.recv(buf)
            assert torch.all(buf == src), f"message from {src} carries {buf.tolist()}"
            seen.add(src)
        assert seen == set(range(1, ws))
    else:
        dist.send(torch.full((4,), rank, dtype=torch.int64), 0)
    # Non-contiguous send and receive.
    m = make_input(13, rank, 36, torch.float32).reshape(6, 6)
    if rank == 0:
        dist.send(m.t(), 1)
    elif rank == 1:
        r = torch.zeros(6, 6).t()
        dist.recv(r, 0)
        assert_bitwise_equal(r.contiguous(), make_input(13, 0, 36, torch.float32).reshape(6, 6).t().contiguous(),
                             "non-contiguous recv")
    dist.barrier()
    return True


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_p2p(ws):
    run_ranks(_p2p_body, ws)


def _many_messages_body(rank, ws):
    # Thousands of small messages keep their order; interleaved with collectives.
    n = 2000
    if rank == 0:
        works = [dist.isend(torch.tensor([i], dtype=torch.int32), 1) for i in range(n)]
        dist.all_reduce(torch.ones(1))
        for w in works:
            w.wait()
    else:
        got = []
        dist.all_reduce(torch.ones(1))
        for _ in range(n):
            t = torch.empty(1, dtype=torch.int32)
            dist.recv(t, 0)
            got.append(int(t))
        assert got == list(range(n))
    return True


def test_many_messages_in_order():
    run_ranks(_many_messages_body, 2)


def _error_of(fn):
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    raise AssertionError("expected a RuntimeError")


def _mismatch_body(rank, ws):
    out = {}
    # (name, sent, received): a large message is still being sent when the receive rejects it.
    cases = [("dtype", torch.ones(4), torch.empty(4, dtype=torch.int32)),
             ("size", torch.ones(4), torch.empty(5)),
             ("large", torch.ones(1 << 20), torch.empty(1 << 20, dtype=torch.int32))]
    for name, sent, received in cases:
        g = dist.new_group(backend="tdx")
        if rank == 0:
            work = dist.isend(sent, 1, group=g, tag=7)
            try:
                work.wait()
            except RuntimeError as e:  # the send itself was still running
                out[name] = str(e)
            dist.barrier(group=g)  # the receiver has rejected it
            if name not in out:  # the send had completed: the next one to that rank raises
                out[name] = _error_of(lambda: dist.send(sent, 1, group=g, tag=7))
        else:
            out[name] = _error_of(lambda: dist.recv(received, 0, group=g, tag=7))
            dist.barrier(group=g)
        dist.destroy_process_group(g)
    return out


def test_recv_with_another_dtype_or_size_raises_on_both_sides():
    results = run_ranks(_mismatch_body, 2)
    for rank, res in enumerate(results):
        for name, want in (("dtype", ("16 bytes of Float", "16 bytes of Int")),
                           ("size", ("16 bytes of Float", "20 bytes of Float")),
                           ("large", ("4194304 bytes of Float", "4194304 bytes of Int"))):
            msg = res[name]
            for text in want + ("rank 0", "rank 1", "tag 7", "same dtype and number of elements"):
                assert text in msg, f"rank {rank}, {name}: {text!r} not in {msg}"
