"""Failing loudly: dead ranks, mismatched collectives, bad inputs, abort/destroy, broken p2p channels.

Every case asserts the error text and the time to fail. Cases are grouped so that one spawn of the
ranks covers several of them where the group survives (mismatches run on fresh subgroups).
"""
import glob
import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from _reference import expect_raises

PG_TIMEOUT = 15.0  # long enough that failing by timeout instead of by detection is caught
MARGIN = 5.0


def _segments():
    return set(glob.glob("/dev/shm/tdx-*"))


# --- a rank dies in the middle of an operation ---------------------------------------------------

def _run_op(op, rank, ws, victim, step):
    """One iteration of `op`; every rank calls it with the same arguments."""
    if op == "all_reduce_small":
        dist.all_reduce(torch.ones(16))
    elif op == "all_reduce_large":
        dist.all_reduce(torch.ones(1 << 20))  # 4 MiB: chunked reduce-scatter + all-gather
    elif op == "broadcast":
        dist.broadcast(torch.ones(1 << 18), src=0)
    elif op == "all_gather":
        dist.all_gather([torch.empty(1 << 16) for _ in range(ws)], torch.ones(1 << 16))
    elif op == "reduce_scatter":
        dist.reduce_scatter(torch.empty(1 << 16), [torch.ones(1 << 16) for _ in range(ws)])
    elif op == "all_to_all":
        dist.all_to_all_single(torch.empty(ws * 1024), torch.ones(ws * 1024))
    elif op == "barrier":
        dist.barrier()
    elif op == "recv":  # survivors receive from the victim, which keeps sending
        if rank == victim:
            dist.send(torch.ones(64), dst=0)
        elif rank == 0:
            dist.recv(torch.empty(64), src=victim)
    elif op == "send":  # survivors send messages larger than the ring to the victim
        if rank == victim:
            dist.recv(torch.empty(1 << 20), src=0)
        elif rank == 0:
            dist.send(torch.ones(1 << 20), dst=victim)
    else:
        raise ValueError(op)


def _death_body(rank, ws, op, mode, victim):
    if rank == victim:
        if mode == "exception":
            time.sleep(0.5)
            raise RuntimeError("injected failure")
        # Die from another thread while the main thread is inside the operation.
        def die():
            if mode == "exit":
                os._exit(7)
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Timer(0.5, die).start()
        while True:
            _run_op(op, rank, ws, victim, 0)
    if op in ("recv", "send") and rank != 0:
        time.sleep(2 * PG_TIMEOUT)  # a bystander of the p2p case
        return None
    step = 0
    while True:
        step += 1
        start = time.monotonic()
        try:
            _run_op(op, rank, ws, victim, step)
        except dist.DistBackendError as e:
            return str(e), time.monotonic() - start
        if step > 200000:
            raise AssertionError("the operation kept succeeding after the victim died")


DEATH_CASES = [
    ("all_reduce_small", "exception", 2, "all_reduce"),
    ("all_reduce_large", "sigkill", 2, "all_reduce"),
    ("broadcast", "exit", 2, "broadcast"),
    ("all_gather", "sigkill", 3, "all_gather"),
    ("reduce_scatter", "exception", 2, "reduce_scatter"),
    ("all_to_all", "exit", 2, "all_to_all_single"),
    ("barrier", "sigkill", 3, "barrier"),
    ("recv", "exit", 2, "recv"),
    ("send", "sigkill", 2, "send"),
]


@pytest.mark.parametrize("op,mode,ws,name", DEATH_CASES, ids=[f"{c[0]}-{c[1]}-ws{c[2]}" for c in DEATH_CASES])
def test_dead_rank_detected(op, mode, ws, name):
    victim = ws - 1
    before = _segments()
    out = run_ranks(_death_body, ws, op, mode, victim, pg_timeout=PG_TIMEOUT, expect_failure_ranks=True,
                    timeout=PG_TIMEOUT * 3)
    status, payload = out[victim]
    assert status in ("error", "died"), out[victim]
    if mode == "exception":
        assert status == "error" and "injected failure" in payload
    survivors = [0] if op in ("recv", "send") else [r for r in range(ws) if r != victim]
    for r in survivors:
        status, payload = out[r]
        assert status == "ok", f"rank {r}: {status}: {payload}"
        msg, elapsed = payload
        assert f"{name} (sequence " in msg, msg
        assert f"rank {victim} (pid " in msg and "exited" in msg, msg
        assert elapsed < PG_TIMEOUT + MARGIN, f"rank {r} failed after {elapsed:.1f} s: {msg}"
    # The dead rank's segment was unlinked when everyone had mapped it; survivors left nothing.
    assert not (_segments() - before), _segments() - before


# --- mismatched collectives ---------------------------------------------------------------------

def _mismatch_case(case, rank, g):
    ws = dist.get_world_size(g)
    if case == "op":
        if rank == 0:
            dist.all_reduce(torch.ones(8), group=g)
        else:
            dist.broadcast(torch.ones(8), src=0, group=g)
    elif case == "dtype":
        dist.all_reduce(torch.ones(8, dtype=torch.float32 if rank == 0 else torch.int32), group=g)
    elif case == "count":
        dist.all_reduce(torch.ones(8 + rank), group=g)
    elif case == "count_large":
        dist.all_reduce(torch.ones((1 << 20) + rank), group=g)
    elif case == "reduce_root":
        dist.reduce(torch.ones(8), dst=rank, group=g)
    elif case == "broadcast_root":
        dist.broadcast(torch.ones(8), src=rank, group=g)
    elif case in ("broadcast_root_mixed", "gather_root", "scatter_root", "reduce_root_mixed"):
        # Every rank names a root of its own (all different), or at ws >= 3 ranks 0 and 1 agree on
        # root 0 while rank 2 names root 1 ("mixed"): rank 1's root agrees with it, yet it must raise.
        root = rank if not case.endswith("_mixed") else (1 if rank == 2 else 0)
        t = torch.ones(8)
        if case.startswith("broadcast"):
            dist.broadcast(t, src=root, group=g)
        elif case.startswith("reduce"):
            dist.reduce(t, dst=root, group=g)
        elif case == "gather_root":
            dist.gather(t, [torch.empty(8) for _ in range(ws)] if rank == root else None, dst=root, group=g)
        else:
            dist.scatter(t, [torch.ones(8) for _ in range(ws)] if rank == root else None, src=root, group=g)
    elif case == "reduce_op":
        dist.all_reduce(torch.ones(8), op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX, group=g)
    elif case == "gather_size":
        n = 8 if rank == 0 else 9
        dist.gather(torch.ones(n), [torch.empty(n) for _ in range(ws)] if rank == 0 else None, dst=0, group=g)
    elif case == "scatter_size":
        n = 8 if rank == 0 else 9
        dist.scatter(torch.empty(n), [torch.ones(n) for _ in range(ws)] if rank == 0 else None, src=0, group=g)
    elif case == "all_to_all_self":  # what each pair sends matches; each rank's block to itself does not
        ins, outs = ([1, 3], [2, 2]) if rank == 0 else ([2, 2], [3, 1])
        dist.all_to_all_single(torch.empty(4), torch.ones(4), output_split_sizes=outs, input_split_sizes=ins,
                               group=g)
    elif case == "all_to_all_splits":
        splits = [2, 2] if rank == 0 else [1, 3]
        dist.all_to_all_single(torch.empty(4), torch.ones(4), output_split_sizes=splits, input_split_sizes=splits,
                               group=g)
    else:
        raise ValueError(case)


def _mismatch_body(rank, ws, cases):
    results = {}
    for case in cases:
        g = dist.new_group(backend="tdx")
        start = time.monotonic()
        where, msg = None, None
        try:
            _mismatch_case(case, rank, g)
            try:
                dist.barrier(group=g)  # the follow-up operation
            except RuntimeError as e:
                where, msg = "follow-up", f"{type(e).__name__}: {e}"
        except RuntimeError as e:  # DistBackendError, or torch's own wrapper under DETAIL
            where, msg = "op", f"{type(e).__name__}: {e}"
        results[case] = (where, msg, time.monotonic() - start)
        dist.destroy_process_group(g)
    return results


# Cases where the ranks wait for each other in the first synchronization: caught by the cheap checks.
CHEAP_CASES = ["op", "dtype", "count", "count_large", "reduce_root", "reduce_op", "all_to_all_splits",
               "all_to_all_self"]
# Rooted cases, where the root would wait for nobody: every rank compares every rank's descriptor
# in the first round, so every rank raises in the operation itself with cheap checks too (but for
# gather_size, see test_mismatches_cheap_checks).
ROOTED_CASES = ["gather_size", "scatter_size", "broadcast_root", "gather_root", "scatter_root"]
ROOT_CASES_WS3 = ["broadcast_root", "gather_root", "scatter_root", "broadcast_root_mixed", "reduce_root_mixed"]
TEXT = {"op": "broadcast", "dtype": "int32", "count": "bytes", "count_large": "bytes", "reduce_root": "root",
        "broadcast_root": "root", "gather_root": "root", "scatter_root": "root", "broadcast_root_mixed": "root",
        "reduce_root_mixed": "root", "reduce_op": "MAX", "gather_size": "bytes", "scatter_size": "bytes",
        "all_to_all_splits": "split sizes", "all_to_all_self": "expects 8 bytes from itself"}


def _check_mismatch(results, cases, where_ok, torch_wrapper=False):
    for rank, res in enumerate(results):
        for case in cases:
            where, msg, elapsed = res[case]
            assert where in where_ok[case], f"rank {rank}, {case}: raised in {where!r}: {msg}"
            if torch_wrapper and "DistBackendError" not in msg:
                # torch wraps plugin backends in its ProcessGroupWrapper under DETAIL, which may
                # catch the mismatch before tdx sees it.
                assert "mismatch" in msg.lower(), f"rank {rank}, {case}: {msg}"
                continue
            assert msg.startswith("DistBackendError"), f"rank {rank}, {case}: {msg}"
            assert "mismatched" in msg and TEXT[case] in msg, f"rank {rank}, {case}: {msg}"
            assert elapsed < PG_TIMEOUT, f"rank {rank}, {case}: took {elapsed:.1f} s: {msg}"


def test_mismatches_cheap_checks():
    cases = CHEAP_CASES + ROOTED_CASES
    results = run_ranks(_mismatch_body, 2, cases, pg_timeout=PG_TIMEOUT)
    where_ok = {c: ("op",) for c in cases}
    # A gather's blocks may be uneven in the core: only its root checks sizes, the others learn of it next.
    where_ok["gather_size"] = ("op", "follow-up")
    _check_mismatch(results, cases, where_ok)


def test_rooted_ops_whose_ranks_name_different_roots_raise_in_the_call_on_every_rank():
    """3 ranks: each names its own root, or ranks 0 and 1 agree on root 0 while rank 2 names 1."""
    results = run_ranks(_mismatch_body, 3, ROOT_CASES_WS3, pg_timeout=PG_TIMEOUT)
    _check_mismatch(results, ROOT_CASES_WS3, {c: ("op",) for c in ROOT_CASES_WS3})


@pytest.mark.parametrize("env", [{"TDX_DEBUG": "1"}, {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}], ids=["tdx", "torch"])
def test_mismatches_full_checks_raise_in_the_op_on_every_rank(env):
    cases = ["op", "dtype", "count", "broadcast_root", "reduce_op", "gather_size", "scatter_size",
             "all_to_all_splits"]
    if "TDX_DEBUG" not in env:
        cases = ["broadcast_root", "gather_size"]  # the switch; the cases themselves ran above
    results = run_ranks(_mismatch_body, 2, cases, pg_timeout=PG_TIMEOUT, env=env)
    _check_mismatch(results, cases, {c: ("op",) for c in cases}, torch_wrapper="TDX_DEBUG" not in env)


def _self_block_body(rank, ws, ins, outs, nout):
    g = dist.new_group(backend="tdx")
    expect_raises(dist.DistBackendError, "from itself", lambda: dist.all_to_all_single(
        torch.empty(nout), torch.arange(4.0), output_split_sizes=outs, input_split_sizes=ins, group=g))
    return True


@pytest.mark.parametrize("case", ["no-splits", "splits"])
def test_all_to_all_whose_block_to_itself_differs_raises_at_one_rank(case):
    """At one rank the split matrix is the block to itself: 4 elements sent, 3 expected (gloo's
    alltoall refuses both; tdx copied 3 of the 4 and returned)."""
    ins, outs, nout = (None, None, 3) if case == "no-splits" else ([4], [3], 3)
    run_ranks(_self_block_body, 1, ins, outs, nout)


def _refused_call(op, rank, ws, g):
    """One call of `op` on `g`; rank 0 passes an argument that tdx refuses, the others valid ones."""
    bad = rank == 0
    if op in ("gather", "scatter"):
        lst = [torch.ones(3) for _ in range(ws)] if bad else None  # 3 elements, 2 expected
        if op == "gather":
            return dist.gather(torch.ones(2), lst, dst=0, group=g)
        return dist.scatter(torch.empty(2), lst, src=0, group=g)
    if op == "all_gather":
        return dist.all_gather([torch.empty(2) for _ in range(ws - bad)], torch.ones(2), group=g)
    if op == "all_gather_into_tensor":
        return dist.all_gather_into_tensor(torch.empty(2 * ws + bad), torch.ones(2), group=g)
    if op == "reduce_scatter":
        return dist.reduce_scatter(torch.empty(2), [torch.ones(2 + (bad and p == 1)) for p in range(ws)], group=g)
    if op == "reduce_scatter_tensor":
        return dist.reduce_scatter_tensor(torch.empty(2), torch.ones(2 * ws + bad), group=g)
    if op == "all_to_all":
        return dist.all_to_all([torch.empty(2) for _ in range(ws - bad)], [torch.ones(2) for _ in range(ws)], group=g)
    if op == "all_to_all_single":
        return dist.all_to_all_single(torch.empty(2 * ws), torch.ones(2 * ws), group=g,
                                      input_split_sizes=[2] * (ws - 1) + [2 + bad])
    if op == "all_reduce":  # a bitwise op on floats, on rank 0 only
        return dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BXOR if bad else dist.ReduceOp.SUM, group=g)
    raise AssertionError(op)


_REFUSED = {"gather": "gather_list[0] has 3 elements", "scatter": "scatter_list[0] has 3 elements",
            "all_gather": "output list has 2 tensors but the group has 3 ranks",
            "all_gather_into_tensor": "must have world size", "reduce_scatter": "input_list[1] has 3 elements",
            "reduce_scatter_tensor": "must have world size",
            "all_to_all": "got 3 inputs and 2 outputs for a group of 3 ranks",
            "all_to_all_single": "input split sizes sum to 7", "all_reduce": "BXOR is a bitwise op"}


def _refused_call_body(rank, ws, op):
    g = dist.new_group(backend="tdx")
    start = time.monotonic()
    try:
        _refused_call(op, rank, ws, g)
    except Exception as e:  # noqa: BLE001  the type is checked below
        result = (type(e).__name__, str(e), time.monotonic() - start)
    else:
        result = ("returned", "", time.monotonic() - start)
    dist.barrier()  # rank 0 stays alive until every rank has its answer (WORLD is another group)
    return result


@pytest.mark.parametrize("op", sorted(_REFUSED))
def test_call_refused_on_one_rank_fails_it_on_every_rank(op):
    """Rank 0 alone passes an argument tdx refuses (ValueError there); the other ranks, already waiting
    in the call, raise at once quoting the refusal instead of at the timeout."""
    results = run_ranks(_refused_call_body, 3, op, pg_timeout=PG_TIMEOUT)
    kind, msg, _ = results[0]
    assert kind == "ValueError" and _REFUSED[op] in msg, results[0]
    for rank in (1, 2):
        kind, msg, elapsed = results[rank]
        assert kind == "DistBackendError", f"rank {rank}: {results[rank]}"
        assert "rank 0 refused the call: tdx: " in msg and _REFUSED[op] in msg, msg
        assert elapsed < PG_TIMEOUT / 3, f"rank {rank} waited {elapsed:.1f} s: {msg}"


# --- bad inputs ----------------------------------------------------------------------------------

_expect = expect_raises


def _bad_inputs_body(rank, ws):
    pg = dist.group.WORLD
    be = pg._get_backend(torch.device("cpu"))
    # Wrong device: torch routes by device, so hand a meta tensor to the tdx backend directly.
    _expect(RuntimeError, "is on meta but tdx handles CPU and CUDA tensors only", lambda: be.allreduce([torch.ones(2, device="meta")]))
    _expect(TypeError, "mix dtypes", lambda: be.allreduce([torch.ones(2), torch.ones(2, dtype=torch.float64)]))
    _expect(ValueError, "root rank 2 is out of range", lambda: pg.broadcast(torch.ones(2), 2))
    _expect(ValueError, "peer rank 5 is out of range", lambda: be.send([torch.ones(2)], 5, 0))
    _expect(ValueError, "peer rank -3 is out of range", lambda: be.recv([torch.ones(2)], -3, 0))
    _expect(ValueError, "BXOR is a bitwise op", lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BXOR))
    _expect(ValueError, "must have world size", lambda: dist.all_gather_into_tensor(torch.empty(3), torch.ones(2)))
    _expect(ValueError, "reduce_scatter: input_list[1] has 3 elements",
            lambda: dist.reduce_scatter(torch.empty(2), [torch.ones(2), torch.ones(3)]))
    _expect(ValueError, "split sizes for a group of 2 ranks",
            lambda: dist.all_to_all_single(torch.empty(4), torch.ones(4), input_split_sizes=[1, 1, 2]))
    # The group still works after refused calls.
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.all(t == ws)
    # Use after destroy_process_group: through torch, and through a kept backend object.
    dist.destroy_process_group()
    try:
        dist.all_reduce(torch.ones(2))
        raise AssertionError("all_reduce after destroy_process_group did not raise")
    except (RuntimeError, ValueError) as e:
        assert "not been initialized" in str(e) or "destroyed" in str(e), str(e)
    _expect(RuntimeError, "after it was shut down or destroyed", lambda: be.allreduce([torch.ones(2)]))
    _expect(RuntimeError, "after it was shut down or destroyed", lambda: be.send([torch.ones(2)], 1 - rank, 0))
    return True


def test_bad_inputs():
    run_ranks(_bad_inputs_body, 2)


# --- abort / destroy interrupt a blocked wait ----------------------------------------------------

def _interrupt_body(rank, ws):
    g = dist.new_group(backend="tdx")
    out = {}
    if rank == 0:
        be = g._get_backend(torch.device("cpu"))
        threading.Timer(0.5, be.abort).start()
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(8), group=g)  # rank 1 never joins
        except dist.DistBackendError as e:
            out["abort"] = (str(e), time.monotonic() - start)
        threading.Timer(0.5, dist.destroy_process_group).start()
        start = time.monotonic()
        try:
            dist.all_reduce(torch.ones(8))
        except dist.DistBackendError as e:
            out["destroy"] = (str(e), time.monotonic() - start)
    else:
        time.sleep(2.5)  # alive but absent: only the abort / destroy can end rank 0's waits
    return out


def test_abort_and_destroy_interrupt_blocked_waits():
    out = run_ranks(_interrupt_body, 2, pg_timeout=30.0)[0]
    for key in ("abort", "destroy"):
        assert key in out, out
        msg, elapsed = out[key]
        assert "all_reduce (sequence " in msg and "aborted" in msg, msg
        assert elapsed < 3.0, f"{key} took {elapsed:.1f} s to interrupt the wait: {msg}"


# --- broken p2p channels -------------------------------------------------------------------------

BIG = 1 << 20  # 4 MiB of float32: larger than the 1 MiB ring


def _p2p_break_body(rank, ws):
    pids = [None] * ws
    dist.all_gather_object(pids, os.getpid())
    out = {}
    # 1) rank 0's send times out after writing part of its message (rank 1 receives nothing).
    if rank == 0:
        start = time.monotonic()
        try:
            dist.send(torch.ones(BIG), dst=1)
        except dist.DistBackendError as e:
            out["send_timeout"] = (str(e), time.monotonic() - start)
        start = time.monotonic()
        try:
            dist.send(torch.ones(4), dst=1)
        except dist.DistBackendError as e:
            out["send_after"] = (str(e), time.monotonic() - start)
    else:
        time.sleep(PG_TIMEOUT_P2P + 0.5)
        try:
            dist.recv(torch.empty(BIG), src=0)
        except dist.DistBackendError as e:
            out["recv_broken"] = str(e)
    # 2) rank 1 stops (SIGSTOP) in the middle of a message: rank 0's receive times out.
    dist.barrier()
    if rank == 1:
        w = dist.isend(torch.ones(BIG), dst=0)
        time.sleep(0.3)  # the ring fills, then the send waits for space
        os.kill(os.getpid(), signal.SIGSTOP)
        try:
            w.wait()
        except dist.DistBackendError as e:
            out["stalled_send"] = str(e)
    else:
        time.sleep(1.0)  # rank 1 is stopped by now, its ring full
        start = time.monotonic()
        try:
            dist.recv(torch.empty(BIG), src=1)
        except dist.DistBackendError as e:
            out["recv_timeout"] = (str(e), time.monotonic() - start)
        os.kill(pids[1], signal.SIGCONT)
        start = time.monotonic()
        try:
            dist.recv(torch.empty(4), src=1)
        except dist.DistBackendError as e:
            out["recv_after"] = (str(e), time.monotonic() - start)
    dist.barrier()
    return out


PG_TIMEOUT_P2P = 2.0


def test_p2p_partial_messages_break_the_channel():
    r0, r1 = run_ranks(_p2p_break_body, 2, pg_timeout=PG_TIMEOUT_P2P)
    msg, elapsed = r0["send_timeout"]
    assert "send (sequence 1" in msg and "having written" in msg and "broken" in msg, msg
    assert PG_TIMEOUT_P2P - 0.1 <= elapsed < PG_TIMEOUT_P2P + MARGIN, elapsed
    msg, elapsed = r0["send_after"]
    assert "channel to rank 1 is broken" in msg and "half-written" in msg, msg
    assert elapsed < 1.0, elapsed
    assert "channel from rank 0 is broken" in r1["recv_broken"], r1["recv_broken"]
    msg, elapsed = r0["recv_timeout"]
    assert "having received" in msg and "stopped sending in the middle" in msg, msg
    assert PG_TIMEOUT_P2P - 0.1 <= elapsed < PG_TIMEOUT_P2P + MARGIN, elapsed
    msg, elapsed = r0["recv_after"]
    assert "channel from rank 1 is broken" in msg and "half-read" in msg, msg
    assert elapsed < 1.0, elapsed
    assert "stalled_send" in r1, r1
