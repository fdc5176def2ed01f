"""The multi-host (hierarchical) mode: several simulated hosts on one machine via TDX_NODE_ID.

Every operation runs against a single-process reference. Integers and data movement must match
exactly; floating-point reductions fold in a different order across hosts than the rank-order
reference, so they are compared with a tolerance. Every rank returns its all_reduce results and
the parent checks they are bit-identical across ranks.
"""
import datetime
import functools
import os
import time

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from test_collectives import _gather_body
from _reference import ALL_DTYPES, FLOAT_DTYPES, R, assert_bitwise_equal, fold, make_input, ops_for

# world size -> ranks per simulated host
LAYOUTS = {"2x2": (4, 2), "2+1": (3, 2), "3x1": (3, 1), "4x1": (4, 1)}
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 1e-2, torch.bfloat16: 2e-2}
SIZES = [1, 7, 1000, 70001]


def _node_env(per_host, rank):
    return {"TDX_NODE_ID": f"simhost{rank // per_host}"}


def check(actual, expected, what, inputs=None, op=None):
    """Exact for integers and bool, within a tolerance (fold order) for floating point.

    `inputs`, `op`: the ranks' inputs of an fp16/bf16 SUM or PRODUCT. Gloo folds in that width, and
    each host's partial is rounded to it before it crosses hosts, so an element may also be off by
    the bound of a fold rounded at every step: (ranks - 1) * u * sum(|x|) for a sum, (ranks - 1) * u *
    |product| for a product (u: the unit roundoff). From 8 ranks that exceeds the fixed tolerance (a
    sum where large partials cancel; any product of 16).
    """
    if expected.dtype in TOL:
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, what
        tol = TOL[expected.dtype]
        if inputs is not None and op in (R.SUM, R.PRODUCT) and expected.dtype in (torch.float16, torch.bfloat16):
            u = torch.finfo(expected.dtype).eps / 2
            scale = sum(x.double().abs() for x in inputs) if op == R.SUM else expected.double().abs()
            bound = tol + tol * expected.double().abs() + (len(inputs) - 1) * u * scale
            err = (actual.double() - expected.double()).abs()
            i = int((err - bound).argmax())
            assert err[i] <= bound[i], f"{what}: element {i} is {actual[i]}, expected {expected[i]} (bound {bound[i]:.3g})"
            return
        torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol, msg=what)
    else:
        assert_bitwise_equal(actual, expected, what)


def _reductions(rank, ws):
    results = {}
    case = 0
    for dtype in ALL_DTYPES:
        for op in ops_for(dtype):
            for numel in SIZES:
                case += 1
                xs = [make_input(case, r, numel, dtype, op) for r in range(ws)]
                t = xs[rank].clone()
                dist.all_reduce(t, op=op)
                check(t, fold(xs, op, dtype), f"all_reduce {dtype} {op} numel={numel}",
                      inputs=xs, op=op)
                results[f"all_reduce {dtype} {op} {numel}"] = t
    base = make_input(999, rank, 64, torch.float32).reshape(8, 8)
    view = base.t()
    dist.all_reduce(view)
    check(view.contiguous(), fold([make_input(999, r, 64, torch.float32).reshape(8, 8).t() for r in range(ws)],
                                  R.SUM, torch.float32).contiguous(), "non-contiguous all_reduce")
    cs = [torch.complex(make_input(5, r, 33, torch.float32), make_input(6, r, 33, torch.float32)) for r in range(ws)]
    c = cs[rank].clone()
    dist.all_reduce(c)
    check(torch.view_as_real(c), fold([torch.view_as_real(x) for x in cs], R.SUM, torch.float32), "complex")
    xs = [make_input(7, r, 4096, torch.float32) for r in range(ws)]
    t = xs[rank].clone()
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    work.wait()
    assert work.is_completed()
    check(fut.value()[0], fold(xs, R.SUM, torch.float32), "future value")
    ts = [make_input(8, rank, n, torch.float64) for n in (3, 1000, 5)]
    refs = [fold([make_input(8, r, n, torch.float64) for r in range(ws)], R.SUM, torch.float64) for n in (3, 1000, 5)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for x in ts:
            dist.all_reduce(x)
    cm.wait()
    for i, (x, ref) in enumerate(zip(ts, refs)):
        check(x, ref, "coalesced all_reduce")
        results[f"coalesced {i}"] = x
    # reduce to every root; non-roots keep their tensors.
    for root in range(ws):
        for dtype in (torch.float32, torch.int16, torch.bool):
            for op in (R.SUM, R.MAX):
                xs = [make_input(300 + root, r, 2049, dtype) for r in range(ws)]
                t = xs[rank].clone()
                dist.reduce(t, dst=root, op=op)
                check(t, fold(xs, op, dtype) if rank == root else xs[rank], f"reduce {dtype} {op} to {root}")
        # Above 256 KiB a reduce takes the sliced route, which reads the non-roots' tensors in place.
        xs = [make_input(320 + root, r, 70001, torch.float32) for r in range(ws)]
        t = xs[rank].clone()
        dist.reduce(t, dst=root)
        check(t, fold(xs, R.SUM, torch.float32) if rank == root else xs[rank], f"large reduce to {root}")
    # reduce_scatter (list), reduce_scatter_tensor, and its coalesced form.
    for dtype, op in ((torch.float32, R.SUM), (torch.float32, R.AVG), (torch.int32, R.MAX), (torch.int16, R.SUM)):
        n = 1001
        xs = [make_input(600, r, n * ws, dtype) for r in range(ws)]
        ref = fold(xs, op, dtype).split(n)
        out = torch.empty(n, dtype=dtype)
        dist.reduce_scatter(out, list(xs[rank].split(n)), op=op)
        check(out, ref[rank], f"reduce_scatter {dtype} {op}")
        out = torch.empty(n, dtype=dtype)
        dist.reduce_scatter_tensor(out, xs[rank], op=op)
        check(out, ref[rank], f"reduce_scatter_tensor {dtype} {op}")
        assert_bitwise_equal(xs[rank], make_input(600, rank, n * ws, dtype), "reduce_scatter leaves its input")
    ins = [make_input(610 + i, rank, n * ws, torch.float32) for i, n in enumerate((3, 500))]
    outs = [torch.empty(n) for n in (3, 500)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, i in zip(outs, ins):
            dist.reduce_scatter_tensor(o, i)
    cm.wait()
    for i, (o, n) in enumerate(zip(outs, (3, 500))):
        ref = fold([make_input(610 + i, r, n * ws, torch.float32) for r in range(ws)], R.SUM, torch.float32)
        check(o, ref.split(n)[rank], "coalesced reduce_scatter_tensor")
    return results


def _movement(rank, ws):
    for root in range(ws):
        for dtype in ALL_DTYPES:
            src = make_input(100 + root, root, 3000, dtype)
            t = src.clone() if rank == root else torch.zeros(3000, dtype=dtype)
            dist.broadcast(t, src=root)
            assert_bitwise_equal(t, src, f"broadcast {dtype} from {root}")
        # Non-contiguous and empty tensors; several tensors in one call (DDP's start).
        src = make_input(150 + root, root, 64, torch.float32).reshape(8, 8)
        t = torch.zeros(8, 8).t()
        if rank == root:
            t.copy_(src)
        dist.broadcast(t, src=root)
        assert not t.is_contiguous()
        assert_bitwise_equal(t.contiguous(), src, f"non-contiguous broadcast from {root}")
        dist.broadcast(torch.empty(0), src=root)
        ts = [make_input(160 + i, root, n, torch.float64) for i, n in enumerate((5, 70001, 3))]
        mine = [x.clone() if rank == root else torch.zeros_like(x) for x in ts]
        dist._broadcast_coalesced(dist.group.WORLD, mine, 1 << 20, root)
        for i, (x, ref) in enumerate(zip(mine, ts)):
            assert_bitwise_equal(x, ref, f"coalesced broadcast {i} from {root}")
    # all_gather (list, into_tensor, coalesced), gather to every root, object collectives: the
    # single-host test's body, run here across hosts.
    _gather_body(rank, ws)
    # From 4 MiB of output the sliced all_gather writes each host's part straight into the outputs.
    xs = [make_input(401, r, 300001, torch.float32) for r in range(ws)]
    outs = [torch.empty(300001) for _ in range(ws)]
    dist.all_gather(outs, xs[rank])
    for r in range(ws):
        assert_bitwise_equal(outs[r], xs[r], f"large all_gather from {r}")
    flat = torch.empty(ws * 300001)
    dist.all_gather_into_tensor(flat, xs[rank])
    assert_bitwise_equal(flat, torch.cat(xs), "large all_gather_into_tensor")
    # Uneven all_gather.
    xs = [make_input(402, r, 10 + r, torch.float32) for r in range(ws)]
    outs = [torch.empty(10 + r) for r in range(ws)]
    dist.all_gather(outs, xs[rank])
    for r in range(ws):
        assert_bitwise_equal(outs[r], xs[r], "uneven all_gather")
    for root in range(ws):
        sl = [make_input(700 + root, p, 99, torch.int16) for p in range(ws)]
        out = torch.empty(99, dtype=torch.int16)
        dist.scatter(out, scatter_list=sl if rank == root else None, src=root)
        assert_bitwise_equal(out, sl[rank], f"scatter from {root}")
    # all_to_all_single: even, then uneven with empty blocks; all_to_all with lists.
    inp = torch.stack([make_input(800 + rank, p, 6, torch.int64) for p in range(ws)])
    out = torch.empty_like(inp)
    dist.all_to_all_single(out, inp)
    assert_bitwise_equal(out, torch.stack([make_input(800 + r, rank, 6, torch.int64) for r in range(ws)]),
                         "all_to_all_single")

    def rows(src, dst):
        return make_input(900 + src * 10 + dst, 0, (src + 2 * dst) % 3 * 4, torch.float32).reshape(-1, 4)

    inp = torch.cat([rows(rank, p) for p in range(ws)])
    out = torch.empty(sum(rows(r, rank).shape[0] for r in range(ws)), 4)
    dist.all_to_all_single(out, inp, output_split_sizes=[rows(r, rank).shape[0] for r in range(ws)],
                           input_split_sizes=[rows(rank, p).shape[0] for p in range(ws)])
    assert_bitwise_equal(out, torch.cat([rows(r, rank) for r in range(ws)]), "all_to_all_single, uneven")
    ins = [make_input(950 + rank, p, 3 + p, torch.bfloat16) for p in range(ws)]
    outs = [torch.empty(3 + rank, dtype=torch.bfloat16) for _ in range(ws)]
    dist.all_to_all(outs, ins)
    for r in range(ws):
        assert_bitwise_equal(outs[r], make_input(950 + r, rank, 3 + rank, torch.bfloat16), f"all_to_all from {r}")
    dist.barrier()


def _p2p(rank, ws):
    # Ring exchange, within and across hosts.
    nxt, prv = (rank + 1) % ws, (rank - 1) % ws
    r = torch.empty(5000)
    ops = [dist.P2POp(dist.isend, make_input(20, rank, 5000, torch.float32), nxt), dist.P2POp(dist.irecv, r, prv)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    assert_bitwise_equal(r, make_input(20, prv, 5000, torch.float32), "ring exchange")
    # Receive from any source, non-contiguous on both ends.
    if rank == 0:
        seen = set()
        for _ in range(ws - 1):
            buf = torch.empty(6, 6).t()
            src = dist.recv(buf, tag=3)
            seen.add(src)
            assert_bitwise_equal(buf.contiguous(), make_input(13, src, 36, torch.float32).reshape(6, 6).t().contiguous(),
                                 f"any-source recv from {src}")
        assert seen == set(range(1, ws))
    else:
        dist.send(make_input(13, rank, 36, torch.float32).reshape(6, 6).t(), dst=0, tag=3)
    # The tags of tdx's own broadcast and barrier messages are refused on groups spanning hosts.
    with pytest.raises(ValueError, match="tag 2147483646 is reserved by tdx"):
        dist.send(torch.ones(2), dst=(rank + 1) % ws, tag=0x7ffffffe)
    with pytest.raises(ValueError, match="tag 2147483645 is reserved by tdx"):
        dist.recv(torch.ones(2), src=(rank + 1) % ws, tag=0x7ffffffd)
    dist.barrier()


def _body(rank, ws):
    results = _reductions(rank, ws)
    _movement(rank, ws)
    _p2p(rank, ws)
    return results


@pytest.mark.parametrize("chunk", [None, "4K"], ids=["default-chunks", "4K-chunks"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_multihost(layout, chunk):
    """4K chunks (TDX_XHOST_CHUNK_BYTES) make every cross-host pipeline run many chunks."""
    ws, per_host = LAYOUTS[layout]
    env = {"TDX_XHOST_CHUNK_BYTES": chunk} if chunk else None
    results = run_ranks(_body, ws, rank_env=functools.partial(_node_env, per_host), env=env)
    for key, value in results[0].items():
        for r in range(1, ws):
            assert_bitwise_equal(results[r][key], value, f"{key}: rank {r} differs from rank 0")



# --- failing loudly across hosts ------------------------------------------------------------------

def test_multihost_mismatches_full_checks_raise_in_the_op_on_every_rank():
    """Under TDX_DEBUG=1 every rank compares every rank's descriptor through Gloo: all raise at once."""
    from test_faults import PG_TIMEOUT, TEXT, _mismatch_body

    cases = ["op", "dtype", "count", "reduce_root", "broadcast_root", "reduce_op", "gather_size", "scatter_size"]
    results = run_ranks(_mismatch_body, 4, cases, pg_timeout=PG_TIMEOUT, env={"TDX_DEBUG": "1"},
                        rank_env=functools.partial(_node_env, 2))
    for rank, res in enumerate(results):
        for case in cases:
            where, msg, elapsed = res[case]
            assert where == "op", f"rank {rank}, {case}: raised in {where!r}: {msg}"
            assert "mismatched collectives across hosts" in msg and TEXT[case] in msg, f"rank {rank}, {case}: {msg}"
            assert elapsed < PG_TIMEOUT, f"rank {rank}, {case}: took {elapsed:.1f} s"


def test_multihost_mismatch_inside_a_host_cheap_checks():
    """Without full checks the ranks of a host still compare descriptors before the Gloo part.

    Every rank claims to be the broadcast's root: each host's ranks catch it among themselves.
    """
    from test_faults import PG_TIMEOUT, _mismatch_body

    results = run_ranks(_mismatch_body, 4, ["broadcast_root", "dtype"], pg_timeout=PG_TIMEOUT,
                        rank_env=functools.partial(_node_env, 2))
    for rank, res in enumerate(results):
        where, msg, _ = res["broadcast_root"]
        assert where == "op" and "mismatched collectives" in msg and "root" in msg, f"rank {rank}: {msg}"
        # Rank 0 passes float32, the others int32: host 0 sees it; host 1's ranks agree with each
        # other and fail in the Gloo part once host 0 gave up, naming the operation.
        where, msg, _ = res["dtype"]
        assert where == "op", f"rank {rank}: {msg}"
        if rank < 2:
            assert "mismatched collectives" in msg and "int32" in msg, f"rank {rank}: {msg}"
        else:
            assert "all_reduce (sequence 1) failed in its cross-host part" in msg, f"rank {rank}: {msg}"


def _roots_differ_between_hosts_body(rank, ws, staggered):
    # Staggered: host 0's ranks give up at 3 s, host 1's would at 6 s, so they see host 0's
    # connections close (Gloo closes a connection whose wait timed out) before their own timeout.
    seconds = (3 if rank < 2 else 6) if staggered else 4
    g = dist.new_group(backend="tdx", timeout=datetime.timedelta(seconds=seconds))
    start, where = time.monotonic(), "broadcast"
    try:
        dist.broadcast(torch.ones(1000), src=0 if rank < 2 else 2, group=g)  # each host agrees within
        where = "next"
        time.sleep(2)  # the roots fail at 3-4 s: well inside this all_reduce's own timeout
        dist.all_reduce(torch.ones(4), group=g)
        out = "returned", ""
    except RuntimeError as e:
        out = where, str(e)
    # Connected until every rank has reached its own timeout: an exit closes the connections the
    # others wait on, and they would report that instead of the suspected mismatch.
    time.sleep(max(0.0, start + 8 - time.monotonic()))
    return out


@pytest.mark.parametrize("algo,staggered", [("flat", False), ("sliced", True)], ids=["flat", "sliced-staggered"])
def test_multihost_roots_that_differ_between_hosts_are_suggested_at_the_timeout(algo, staggered):
    """Each host's ranks agree on the root, the hosts do not: nobody can see it before Gloo's timeout,
    and every host reaches the store, so the message suggests a mismatch and TDX_DEBUG=1. The roots
    (flat: each root sends to every rank) and the relays (sliced: each sends to the other host's)
    raise in the broadcast, waiting for a receive that never comes. Their host mates may have had
    their own root's data by then: their broadcast returns and their next operation raises, quoting
    the host mate's failure in the broadcast. A root that times out after the other host's (always
    with staggered timeouts) finds that host's connection closed by Gloo at its timeout: the other
    host's timeout mark in the store says it waited too, and the suggestion is the same."""
    results = run_ranks(functools.partial(_roots_differ_between_hosts_body, staggered=staggered), 4,
                        rank_env=functools.partial(_node_env, 2), env={"TDX_XHOST_ALGO": algo})
    for rank, (where, msg) in enumerate(results):
        assert where == "broadcast" or (rank in (1, 3) and where == "next"), f"rank {rank}: {where} {msg}"
        assert "broadcast (sequence 1) failed in its cross-host part" in msg, f"rank {rank}: {msg}"
        assert "may also have called different collectives" in msg and "TDX_DEBUG=1" in msg, f"rank {rank}: {msg}"
    if staggered:
        closed = "host 'simhost0' (global ranks [0, 1]) closed the connection after timing out in this operation"
        assert closed in results[2][1], results[2]


def _late_barrier(rank, ws):
    late = {ws - 1, 1}  # the last host's last rank and a rank that is not its host's first
    for who in sorted(late):
        if rank == who:
            time.sleep(0.5)
        entered = time.clock_gettime(time.CLOCK_MONOTONIC)  # one clock for the machine's processes
        dist.barrier()
        left = time.clock_gettime(time.CLOCK_MONOTONIC)
        times = [torch.zeros(2, dtype=torch.float64) for _ in range(ws)]
        dist.all_gather(times, torch.tensor([entered, left], dtype=torch.float64))
        last_in = max(t[0].item() for t in times)
        first_out = min(t[1].item() for t in times)
        assert first_out >= last_in, f"late rank {who}: a rank left the barrier {last_in - first_out:.4f} s early"
    return True


@pytest.mark.parametrize("layout", ["2x2", "2+1", "3x1"])
def test_multihost_barrier_holds_every_rank_until_the_last_arrives(layout):
    """The barrier across hosts (host leaders exchange tokens with Gloo p2p, their host mates wait in
    shared memory): nobody leaves before the last rank has entered, whichever rank is late."""
    ws, per_host = LAYOUTS[layout]
    assert all(run_ranks(_late_barrier, ws, rank_env=functools.partial(_node_env, per_host)))


def _host_mate_dies_while_waiting_for_the_root(rank, ws):
    g = dist.new_group(backend="tdx", timeout=datetime.timedelta(seconds=60))
    dist.barrier(group=g)
    if rank == 2:
        time.sleep(1.0)
        os._exit(3)
    if rank == 0:
        time.sleep(8.0)  # late: rank 3's receive waits for it
    start = time.monotonic()
    try:
        dist.broadcast(torch.ones(1000), src=0, group=g)
    except RuntimeError as e:
        return str(e), time.monotonic() - start
    return "returned", time.monotonic() - start


@pytest.mark.parametrize("algo", ["flat", "auto"])
def test_multihost_small_broadcast_waiting_for_its_root_sees_a_host_mate_die(algo):
    """A small broadcast waits for the root's message on the calling thread (Gloo p2p: from the root
    itself on the flat route, which hosts of unequal sizes take; from the relay in shared memory
    between two hosts); its host mate dying ends the wait within a watch period, naming the host
    mate, long before the timeout."""
    out = run_ranks(_host_mate_dies_while_waiting_for_the_root, 4, expect_failure_ranks=True, timeout=120,
                    rank_env=functools.partial(_node_env, 2), env={"TDX_XHOST_ALGO": algo})
    assert out[2][0] == "died", out[2]
    status, payload = out[3]
    assert status == "ok", f"rank 3: {status}: {payload}"
    msg, elapsed = payload
    assert "broadcast (sequence " in msg and "rank 2" in msg, msg
    if algo == "flat":  # rank 3 waits for the root in Gloo: the watcher names the dead host mate
        assert "its host mate failed first" in msg, msg
    else:  # rank 3 waits for the relay, rank 2, in shared memory
        assert "(global rank 2) (pid " in msg and "exited" in msg, msg
    assert elapsed < 5.0, f"rank 3 raised {elapsed:.1f} s into the broadcast: {msg}"
    for r in (0, 1):  # the root's send to the dead rank fails as it is posted: named as readably
        status, (msg, _) = out[r]
        assert status == "ok", f"rank {r}: {status}: {msg}"
        if r == 0 or msg != "returned":  # rank 1 may have had its data first
            assert "broadcast (sequence " in msg and ".cc:" not in msg, f"rank {r}: {msg}"


@pytest.mark.parametrize("victim", [1, 3], ids=["same-host-as-rank0", "other-host"])
def test_multihost_dead_rank(victim):
    """A rank killed mid-all_reduce: its host's ranks name it, the other host's fail in the Gloo part."""
    from test_faults import MARGIN, PG_TIMEOUT, _death_body

    out = run_ranks(_death_body, 4, "all_reduce_small", "sigkill", victim, pg_timeout=PG_TIMEOUT,
                    expect_failure_ranks=True, timeout=PG_TIMEOUT * 3, rank_env=functools.partial(_node_env, 2))
    assert out[victim][0] in ("error", "died"), out[victim]
    names = []
    for r in range(4):
        if r == victim:
            continue
        status, payload = out[r]
        assert status == "ok", f"rank {r}: {status}: {payload}"
        msg, elapsed = payload
        assert "all_reduce (sequence " in msg, msg
        named = (f"(global rank {victim}) (pid " in msg or f" rank {victim} (pid " in msg) and "exited" in msg
        if r // 2 == victim // 2:  # the host's group numbers its ranks locally and gives the global rank
            assert named, msg
        else:  # named through the note the victim's host left in the store, unless none could see it;
            # or, in shared memory, a host mate that already failed in its Gloo part and exited
            assert named or "closed the connection" in msg or "exited" in msg, msg
            names.append(named)
        assert elapsed < PG_TIMEOUT + MARGIN, f"rank {r} failed after {elapsed:.1f} s: {msg}"
    # At least one rank of the other host learns which rank died (the one whose Gloo partner died
    # while its host's ranks were in shared memory).
    assert any(names), out


def _compressed(rank, ws):
    out = {}
    for numel in (1000, 300001):
        xs = [make_input(40, r, numel, torch.float32) for r in range(ws)]
        for op in (R.SUM, R.AVG):
            t = xs[rank].clone()
            dist.all_reduce(t, op=op)
            out[f"{op} {numel}"] = t
        ints = [make_input(41, r, numel, torch.int32) for r in range(ws)]
        t = ints[rank].clone()
        dist.all_reduce(t)
        assert_bitwise_equal(t, fold(ints, R.SUM, torch.int32), "int32 is never compressed")
    return out


@pytest.mark.parametrize("codec", ["bf16", "fp16"])
def test_multihost_compressed_host_links(codec):
    """TDX_XHOST_COMPRESS: float32 sums cross hosts at half width: identical on every rank, close to exact."""
    results = run_ranks(_compressed, 4, rank_env=functools.partial(_node_env, 2), env={"TDX_XHOST_COMPRESS": codec})
    # Each host's partial sum (|x| < 10 here) is rounded once to the codec: half an ulp at 8 each.
    tol = {"bf16": 0.07, "fp16": 0.01}[codec]
    for numel in (1000, 300001):
        xs = [make_input(40, r, numel, torch.float32) for r in range(4)]
        for op in (R.SUM, R.AVG):
            key = f"{op} {numel}"
            torch.testing.assert_close(results[0][key], fold(xs, op, torch.float32), rtol=tol, atol=tol)
            assert not torch.equal(results[0][key], fold(xs, op, torch.float32)), "nothing was compressed"
            for r in range(1, 4):
                assert_bitwise_equal(results[r][key], results[0][key], f"{key}: rank {r} differs from rank 0")


@pytest.mark.parametrize("algo", ["flat", "sliced"])
def test_multihost_routes(algo):
    """TDX_XHOST_ALGO forces one route for every call: both are exact and identical on every rank."""
    results = run_ranks(_body, 4, rank_env=functools.partial(_node_env, 2), env={"TDX_XHOST_ALGO": algo})
    for key, value in results[0].items():
        for r in range(1, 4):
            assert_bitwise_equal(results[r][key], value, f"{key}: rank {r} differs from rank 0")


def _chained_broadcasts(rank, ws):
    out = {}
    for root in range(ws):
        for numel in (1, 5000, 70001):
            src = make_input(700 + root, root, numel, torch.float32)
            t = src.clone() if rank == root else torch.zeros(numel)
            dist.broadcast(t, src=root)
            assert_bitwise_equal(t, src, f"broadcast of {numel} from {root}")
            out[f"{root} {numel}"] = t
        # Above 256 KiB a reduce takes the sliced route: from 3 hosts, a chain up to the root's host.
        for dtype, op in ((torch.float32, R.SUM), (torch.float32, R.AVG), (torch.int32, R.MAX),
                          (torch.float64, R.PRODUCT), (torch.bfloat16, R.SUM)):
            numel = (300 << 10) // torch.tensor([], dtype=dtype).element_size()
            xs = [make_input(720 + root, r, numel, dtype, op) for r in range(ws)]
            t = xs[rank].clone()
            dist.reduce(t, dst=root, op=op)
            check(t, fold(xs, op, dtype) if rank == root else xs[rank], f"reduce {dtype} {op} to {root}",
                  inputs=xs, op=op)
    return out


@pytest.mark.parametrize("layout", ["3x1", "4x1"])
def test_multihost_sliced_broadcast_and_reduce_chain_three_hosts_or_more(layout):
    """From 3 hosts the sliced broadcast passes 4 KiB chunks down a chain of hosts (Gloo p2p in the
    slice group) and the sliced reduce up one, from and to every root: each rank gets the root's
    bytes, the root the reduction, and the other ranks keep their inputs."""
    ws, per_host = LAYOUTS[layout]
    run_ranks(_chained_broadcasts, ws, rank_env=functools.partial(_node_env, per_host),
              env={"TDX_XHOST_ALGO": "sliced", "TDX_XHOST_CHUNK_BYTES": "4K"})


@pytest.mark.parametrize("algo", ["flat", "sliced"])
def test_multihost_all_reduce_coalesced_with_aliased_inputs(algo):
    """Inputs sharing memory across hosts: each entry reduced from the caller's values, as Gloo does."""
    from test_collectives import _aliased_all_reduce_body

    results = run_ranks(_aliased_all_reduce_body, 4, rank_env=functools.partial(_node_env, 2),
                        env={"TDX_XHOST_ALGO": algo})
    for rank_results in results:
        for n, got in rank_results.items():
            expected = torch.arange(n, dtype=torch.float32) * 4 + 6
            for name in ("tdx", "gloo"):
                assert all(torch.equal(t, expected) for t in got[name]), (name, n)


def _host_partials(xs, per_host):
    return [sum(xs[h * per_host:(h + 1) * per_host]) for h in range(len(xs) // per_host)]


@pytest.mark.parametrize("chunk", [None, "4K"], ids=["default-chunks", "4K-chunks"])
def test_multihost_int8_host_links(chunk):
    """TDX_XHOST_COMPRESS=int8: each host's float32 partial crosses as blockwise int8 (a scale per 256).

    Identical bits on every rank; the error of each element is at most half a quantization step of
    every host's partial (max |partial| / 254 per host); int32 and MAX are never compressed.
    """
    env = {"TDX_XHOST_COMPRESS": "int8", **({"TDX_XHOST_CHUNK_BYTES": chunk} if chunk else {})}
    results = run_ranks(_compressed, 4, rank_env=functools.partial(_node_env, 2), env=env)
    for numel in (1000, 300001):
        xs = [make_input(40, r, numel, torch.float32) for r in range(4)]
        step = sum(p.abs().max().item() / 254 for p in _host_partials([x.double() for x in xs], 2))
        for op in (R.SUM, R.AVG):
            key = f"{op} {numel}"
            exact = fold([x.double() for x in xs], op, torch.float64)
            err = (results[0][key].double() - exact).abs()
            bound = step / (4 if op == R.AVG else 1) * 1.001 + 1e-5
            assert err.max().item() <= bound, f"{key}: error {err.max().item()} over the bound {bound}"
            assert err.max().item() > 1e-4, f"{key}: exact to float32 rounding: nothing was compressed"
            for r in range(1, 4):
                assert_bitwise_equal(results[r][key], results[0][key], f"{key}: rank {r} differs from rank 0")


def _make_group(rank, ws):
    try:
        dist.new_group(backend="tdx")
    except Exception as e:  # noqa: BLE001 - the message is the check
        return str(e)
    return "no error"


def test_multihost_knobs_differ_across_ranks_raise_when_the_group_is_made():
    """TDX_XHOST_ALGO chooses the route of every call: ranks that disagree would deadlock, so they raise."""
    def rank_env(rank):
        return {**_node_env(2, rank), "TDX_XHOST_ALGO": "flat" if rank == 3 else "sliced"}

    results = run_ranks(_make_group, 4, backend="gloo", rank_env=rank_env)
    for rank, msg in enumerate(results):
        assert "set TDX_XHOST_ALGO or TDX_XHOST_COMPRESS differently" in msg, f"rank {rank}: {msg}"
