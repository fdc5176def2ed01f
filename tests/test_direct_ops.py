"""torch.ops.tdx.* (the direct in-place collectives) against single-process references, world sizes 1-4.

They share the group's shared memory and sequence with the c10d calls, so the tests mix both, with
async c10d work still queued when a direct op starts. "forced" runs use a 4 KiB collective buffer
and no one-shot path (the chunked algorithms on small inputs).
"""
import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from _reference import ALL_DTYPES, R, assert_bitwise_equal, fold, make_input, ops_for

FORCED_ENV = {"TDX_BUFFER_BYTES": "4096", "TDX_ONESHOT_BYTES": "0"}
_OP_NAMES = {R.SUM: "sum", R.AVG: "avg", R.PRODUCT: "product", R.MIN: "min", R.MAX: "max", R.BAND: "band",
             R.BOR: "bor", R.BXOR: "bxor"}


def _all_reduce_body(rank, ws):
    case = 0
    for dtype in ALL_DTYPES:
        for op in ops_for(dtype):
            for numel in (1, 1000, 70001):
                case += 1
                xs = [make_input(case, r, numel, dtype, op) for r in range(ws)]
                t = xs[rank].clone()
                out = torch.ops.tdx.all_reduce_(t, _OP_NAMES[op].upper() if case % 2 else _OP_NAMES[op])
                assert out is t
                assert_bitwise_equal(t, fold(xs, op, dtype), f"all_reduce_ {dtype} {op} numel={numel}")
    # A subgroup by name, a non-contiguous view, and c10d async work queued before the direct op.
    sub = dist.new_group(list(range(ws)), backend="tdx")
    xs = [make_input(500, r, 64, torch.float32).reshape(8, 8) for r in range(ws)]
    view = xs[rank].clone().t()
    torch.ops.tdx.all_reduce_(view, "max", sub.group_name)
    assert_bitwise_equal(view.contiguous(), fold([x.t() for x in xs], R.MAX, torch.float32).contiguous(), "view")
    a = make_input(501, rank, 300000, torch.float32)
    b = make_input(502, rank, 1000, torch.float64)
    work = dist.all_reduce(a, async_op=True)
    torch.ops.tdx.all_reduce_(b)
    work.wait()
    assert_bitwise_equal(a, fold([make_input(501, r, 300000, torch.float32) for r in range(ws)], R.SUM,
                                 torch.float32), "queued c10d all_reduce")
    assert_bitwise_equal(b, fold([make_input(502, r, 1000, torch.float64) for r in range(ws)], R.SUM,
                                 torch.float64), "direct all_reduce_ after queued work")
    dist.destroy_process_group(sub)
    return True


def _gather_scatter_body(rank, ws):
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for numel in (1, 777, 40000):
            ins = [make_input(600 + numel % 11, r, numel, dtype) for r in range(ws)]
            out = torch.empty(ws * numel, dtype=dtype)
            assert torch.ops.tdx.all_gather_into_tensor_(out, ins[rank]) is out
            assert_bitwise_equal(out, torch.cat(ins), f"all_gather_into_tensor_ {dtype} numel={numel}")
            big = [make_input(700 + numel % 13, r, ws * numel, dtype) for r in range(ws)]
            red = torch.empty(numel, dtype=dtype)
            torch.ops.tdx.reduce_scatter_tensor_(red, big[rank], "max", dist.group.WORLD.group_name)
            want = fold(big, R.MAX, dtype)[rank * numel:(rank + 1) * numel]
            assert_bitwise_equal(red, want, f"reduce_scatter_tensor_ {dtype} numel={numel}")
    return True


def _errors_body(rank, ws):
    t = torch.ones(4)
    with pytest.raises(ValueError, match="unknown reduce op 'mean'.*sum, avg"):
        torch.ops.tdx.all_reduce_(t, "mean")
    with pytest.raises(ValueError, match="no process group named 'nope'"):
        torch.ops.tdx.all_reduce_(t, "sum", "nope")
    gloo = dist.new_group(list(range(ws)), backend="gloo")
    with pytest.raises(ValueError, match="has no tdx backend"):
        torch.ops.tdx.all_reduce_(t, "sum", gloo.group_name)
    with pytest.raises(ValueError, match="all_gather_into_tensor_"):
        torch.ops.tdx.all_gather_into_tensor_(torch.empty(ws * 4 + 1), t)
    with pytest.raises(ValueError, match="BXOR|bxor"):
        torch.ops.tdx.all_reduce_(t, "bxor")
    torch.ops.tdx.all_reduce_(t)  # the group still works after refused calls
    assert torch.equal(t, torch.full((4,), float(ws)))
    dist.destroy_process_group(gloo)
    return True


@pytest.mark.parametrize("forced", [False, True], ids=["default", "forced-chunks"])
@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_direct_all_reduce(ws, forced):
    run_ranks(_all_reduce_body, ws, env=FORCED_ENV if forced else None)


@pytest.mark.parametrize("forced", [False, True], ids=["default", "forced-chunks"])
@pytest.mark.parametrize("ws", [1, 2, 3])
def test_direct_all_gather_and_reduce_scatter(ws, forced):
    run_ranks(_gather_scatter_body, ws, env=FORCED_ENV if forced else None)


@pytest.mark.parametrize("ws", [1, 2])
def test_direct_ops_refuse_bad_arguments(ws):
    run_ranks(_errors_body, ws)
