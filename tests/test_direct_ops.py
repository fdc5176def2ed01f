"""torch.ops.tdx.* (the direct in-place collectives) against single-process references, world sizes 1-4.

They are the group's own collectives (same checks, route, engine and sequence as the c10d calls),
so the tests mix both, with async c10d work still queued when a direct op starts. "forced" runs
use a 4 KiB collective buffer and no one-shot path (the chunked algorithms on small inputs). Also:
"" after dist.shrink_group replaced the default group, a refusal on one rank reaching the others,
and torch.compile(fullgraph=True) of a model calling the ops, against eager.
"""
import time

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
    with pytest.raises(ValueError, match="all_gather_into_tensor: output .*must have world size"):
        torch.ops.tdx.all_gather_into_tensor_(torch.empty(ws * 4 + 1), t)
    with pytest.raises(ValueError, match="BXOR|bxor"):
        torch.ops.tdx.all_reduce_(t, "bxor")
    torch.ops.tdx.all_reduce_(t)  # the group still works after refused calls
    assert torch.equal(t, torch.full((4,), float(ws)))
    dist.destroy_process_group(gloo)
    # A destroyed group is not found again by a thread that resolved its name before.
    sub = dist.new_group(list(range(ws)), backend="tdx")
    name = sub.group_name
    for _ in range(2):
        t = torch.ones(4)
        torch.ops.tdx.all_reduce_(t, "sum", name)
        assert torch.equal(t, torch.full((4,), float(ws)))
    dist.destroy_process_group(sub)
    with pytest.raises(ValueError, match=f"no process group named '{name}'"):
        torch.ops.tdx.all_reduce_(t, "sum", name)
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


def _after_shrink_body(rank, ws):
    """ws = 3: rank 2 leaves, the others shrink the default group, then make a new group of rank 0
    alone (torch names it as it named the old default group, "0")."""
    t = torch.full((5,), float(rank + 1))
    torch.ops.tdx.all_reduce_(t)
    assert torch.equal(t, torch.full((5,), 6.0))
    if rank == ws - 1:
        return "excluded"
    old_name = dist.group.WORLD.group_name
    new = dist.shrink_group([ws - 1])
    assert dist.group.WORLD is new and new.group_name != old_name
    alone = dist.new_group([0], backend="tdx")
    for _ in range(2):  # the shrunk default group (ranks 0 and 1); the second call finds it cached
        t = torch.full((5,), float(rank + 1))
        torch.ops.tdx.all_reduce_(t, "sum", "")
        assert torch.equal(t, torch.full((5,), 3.0)), "'' did not run on the current default group"
    if rank == 0:  # a named group resolves as torch resolves it
        t = torch.full((5,), 7.0)
        torch.ops.tdx.all_reduce_(t, "sum", alone.group_name)
        assert torch.equal(t, torch.full((5,), 7.0))
    out = torch.empty(4)
    torch.ops.tdx.all_gather_into_tensor_(out, torch.full((2,), float(rank)))
    assert torch.equal(out, torch.tensor([0.0, 0.0, 1.0, 1.0]))
    return new.group_name


def test_default_group_after_shrink_group():
    out = run_ranks(_after_shrink_body, 3)
    assert out[2] == "excluded" and out[0] == out[1], out


def _refused_body(rank, ws):
    """Rank 0 passes a reduce op tdx refuses for floats; rank 1, already waiting in the call,
    raises at once quoting it (the c10d call's refusal, shared by the direct op)."""
    g = dist.new_group(backend="tdx")
    start = time.monotonic()
    try:
        torch.ops.tdx.all_reduce_(torch.ones(2), "bxor" if rank == 0 else "sum", g.group_name)
    except Exception as e:  # noqa: BLE001  the type is checked by the caller
        result = (type(e).__name__, str(e), time.monotonic() - start)
    else:
        result = ("returned", "", 0.0)
    dist.barrier()  # rank 0 stays alive until rank 1 has its answer (WORLD is another group)
    return result


def test_refusal_on_one_rank_fails_the_call_on_the_others():
    pg_timeout = 30.0
    out = run_ranks(_refused_body, 2, pg_timeout=pg_timeout)
    assert out[0][0] == "ValueError" and "BXOR is a bitwise op" in out[0][1], out[0]
    kind, msg, elapsed = out[1]
    assert kind == "DistBackendError" and "rank 0 refused the call" in msg and "BXOR" in msg, out[1]
    assert elapsed < pg_timeout / 3, f"rank 1 waited {elapsed:.1f} s for the refusal: {msg}"


class _TensorParallelMLP(torch.nn.Module):
    """A model whose forward calls the three direct ops, by "" and by name."""

    def __init__(self, ws, group_name):
        super().__init__()
        self.ws, self.group_name = ws, group_name
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8 * ws)

    def forward(self, x):
        h = self.up(x)
        torch.ops.tdx.all_reduce_(h, "sum", "")
        h = torch.relu(h)
        gathered = torch.empty(self.ws * h.numel(), dtype=h.dtype)
        torch.ops.tdx.all_gather_into_tensor_(gathered, h.flatten(), self.group_name)
        y = self.down(gathered.view(self.ws, *h.shape).mean(0))
        out = torch.empty(y.numel() // self.ws, dtype=y.dtype)
        torch.ops.tdx.reduce_scatter_tensor_(out, y.flatten(), "avg", "")
        return out.view(-1, 8) * 2


def _compile_body(rank, ws):
    torch.manual_seed(0)
    model = _TensorParallelMLP(ws, dist.group.WORLD.group_name)
    torch.manual_seed(100 + rank)
    xs = [torch.randn(4, 8) for _ in range(2)]
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        eager = [model(x) for x in xs]
        got = [compiled(x) for x in xs]
    for e, g in zip(eager, got):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    return True


def test_torch_compile_fullgraph_traces_the_direct_ops():
    """2 ranks, CPU, torch.compile's default backend: the same results as eager."""
    run_ranks(_compile_body, 2, env={"TORCHINDUCTOR_COMPILE_THREADS": "1"})


def _two_hosts(rank):
    """Rank 0 and rank 1 on two simulated hosts: the group's CPU route is the hierarchical engine."""
    return {"TDX_NODE_ID": f"simhost{rank}"}


def _across_hosts_body(rank, ws):
    xs = [torch.arange(6, dtype=torch.float32) * (r + 1) for r in range(ws)]
    t = xs[rank].clone()
    torch.ops.tdx.all_reduce_(t, "max")
    assert torch.equal(t, xs[-1])
    out = torch.empty(ws * 6)
    torch.ops.tdx.all_gather_into_tensor_(out, xs[rank])
    assert torch.equal(out, torch.cat(xs))
    red = torch.empty(6 // ws)
    torch.ops.tdx.reduce_scatter_tensor_(red, xs[rank], "sum", dist.group.WORLD.group_name)
    assert torch.equal(red, sum(xs)[rank * (6 // ws):(rank + 1) * (6 // ws)])
    return True


def test_direct_ops_across_simulated_hosts():
    run_ranks(_across_hosts_body, 2, rank_env=_two_hosts)
