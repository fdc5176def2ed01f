"""Every c10d collective on backend "tdx" against a single-process reference, world sizes 1-4.

Each test runs one family of operations in one set of processes (spawning is the slow part).
"forced" runs use a 4 KiB collective buffer and no one-shot path, so the chunked,
multi-round algorithms run on small inputs.
"""
import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from _reference import ALL_DTYPES, FLOAT_DTYPES, R, assert_bitwise_equal, fold, make_input, ops_for

WORLD_SIZES = [1, 2, 3, 4]
FORCED_ENV = {"TDX_BUFFER_BYTES": "4096", "TDX_ONESHOT_BYTES": "0"}
# Every all_gather from 64 output bytes reads its peers' inputs directly (the single-copy algorithm).
SINGLE_COPY_ENV = {"TDX_SINGLE_COPY_BYTES": "64"}
GATHER_MODES = {"default": None, "forced-chunks": FORCED_ENV, "single-copy": SINGLE_COPY_ENV}
SIZES = [1, 7, 1000, 70001]


def _all_reduce_body(rank, ws):
    case = 0
    for dtype in ALL_DTYPES:
        for op in ops_for(dtype):
            for numel in SIZES:
                case += 1
                xs = [make_input(case, r, numel, dtype, op) for r in range(ws)]
                t = xs[rank].clone()
                dist.all_reduce(t, op=op)
                assert_bitwise_equal(t, fold(xs, op, dtype), f"all_reduce {dtype} {op} numel={numel}")
    # Non-contiguous input: handled through a contiguous copy written back.
    base = make_input(999, rank, 64, torch.float32).reshape(8, 8)
    view = base.t()
    expected = fold([make_input(999, r, 64, torch.float32).reshape(8, 8).t() for r in range(ws)], R.SUM,
                    torch.float32)
    dist.all_reduce(view)
    assert_bitwise_equal(view.contiguous(), expected.contiguous(), "all_reduce of a non-contiguous view")
    # Complex SUM reduces the real view.
    cs = [torch.complex(make_input(5, r, 33, torch.float32), make_input(6, r, 33, torch.float32)) for r in range(ws)]
    c = cs[rank].clone()
    dist.all_reduce(c)
    assert_bitwise_equal(torch.view_as_real(c), fold([torch.view_as_real(x) for x in cs], R.SUM, torch.float32),
                         "complex all_reduce")
    # PREMUL_SUM (our DDP's reduction): the bits of multiplying every input by the factor, then summing.
    for dtype in FLOAT_DTYPES:
        for numel in SIZES:
            for factor in (1.0 / 3, torch.tensor([0.25], dtype=torch.float64)):
                xs = [make_input(40 + numel % 7, r, numel, dtype) for r in range(ws)]
                t = xs[rank].clone()
                dist.all_reduce(t, op=dist._make_nccl_premul_sum(factor))
                f = float(factor) if isinstance(factor, float) else factor.item()
                assert_bitwise_equal(t, fold([x * f for x in xs], R.SUM, dtype),
                                     f"all_reduce PREMUL_SUM({f}) {dtype} numel={numel}")
    with pytest.raises(ValueError, match="PREMUL_SUM needs a real floating-point tensor"):
        dist.all_reduce(torch.ones(4, dtype=torch.int32), op=dist._make_nccl_premul_sum(0.5))
    with pytest.raises(ValueError, match="PREMUL_SUM is supported by all_reduce"):
        dist.reduce(torch.ones(4), dst=0, op=dist._make_nccl_premul_sum(0.5))
    # async_op: Work.wait, is_completed and the future's value.
    xs = [make_input(7, r, 4096, torch.float32) for r in range(ws)]
    t = xs[rank].clone()
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    work.wait()
    assert work.is_completed()
    assert_bitwise_equal(fut.value()[0], fold(xs, R.SUM, torch.float32), "future value")
    t = xs[rank].clone()
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    fut = work.get_future()  # asked for after completion: made completed
    assert fut.done()
    assert_bitwise_equal(fut.value()[0], fold(xs, R.SUM, torch.float32), "future made after completion")
    # Coalesced: all_reduce_coalesced and the coalescing manager.
    ts = [make_input(8, rank, n, torch.float64) for n in (3, 1000, 5)]
    refs = [fold([make_input(8, r, n, torch.float64) for r in range(ws)], R.MAX, torch.float64) for n in (3, 1000, 5)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for x in ts:
            dist.all_reduce(x, op=R.MAX)
    cm.wait()
    for x, ref in zip(ts, refs):
        assert_bitwise_equal(x, ref, "coalesced all_reduce")
    return True


@pytest.mark.parametrize("forced", [False, True], ids=["default", "forced-chunks"])
@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_all_reduce(ws, forced):
    run_ranks(_all_reduce_body, ws, env=FORCED_ENV if forced else None)


def _rooted_body(rank, ws):
    for root in range(ws):
        for dtype in ALL_DTYPES:
            for numel in (1, 3000):
                case = 100 + root * 50 + ALL_DTYPES.index(dtype) * 2 + (numel > 1)
                src = make_input(case, root, numel, dtype)
                t = src.clone() if rank == root else torch.zeros(numel, dtype=dtype)
                dist.broadcast(t, src=root)
                assert_bitwise_equal(t, src, f"broadcast {dtype} from {root}")
        for dtype in FLOAT_DTYPES + [torch.int32, torch.bool]:
            for op in (R.SUM, R.MAX):
                xs = [make_input(300 + root, r, 2049, dtype) for r in range(ws)]
                t = xs[rank].clone()
                dist.reduce(t, dst=root, op=op)
                if rank == root:
                    assert_bitwise_equal(t, fold(xs, op, dtype), f"reduce {dtype} {op} to {root}")
                else:
                    assert_bitwise_equal(t, xs[rank], "reduce leaves non-root tensors unchanged")
    return True


@pytest.mark.parametrize("forced", [False, True], ids=["default", "forced-chunks"])
@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_broadcast_and_reduce(ws, forced):
    run_ranks(_rooted_body, ws, env=FORCED_ENV if forced else None)


def _gather_body(rank, ws):
    for dtype in (torch.float32, torch.bfloat16, torch.int16, torch.int64, torch.bool):
        for numel in (1, 5000):
            xs = [make_input(400, r, numel, dtype) for r in range(ws)]
            outs = [torch.empty(numel, dtype=dtype) for _ in range(ws)]
            dist.all_gather(outs, xs[rank])
            for r in range(ws):
                assert_bitwise_equal(outs[r], xs[r], f"all_gather {dtype} from rank {r}")
            flat = torch.empty(numel * ws, dtype=dtype)
            dist.all_gather_into_tensor(flat, xs[rank])
            assert_bitwise_equal(flat, torch.cat(xs), f"all_gather_into_tensor {dtype}")
    # Coalesced all_gather_into_tensor.
    ins = [make_input(401 + i, rank, n, torch.float32) for i, n in enumerate((10, 3333))]
    outs = [torch.empty(n * ws) for n in (10, 3333)]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, i in zip(outs, ins):
            dist.all_gather_into_tensor(o, i)
    cm.wait()
    for i, (o, n) in enumerate(zip(outs, (10, 3333))):
        assert_bitwise_equal(o, torch.cat([make_input(401 + i, r, n, torch.float32) for r in range(ws)]),
                             "coalesced all_gather_into_tensor")
    # gather to every root.
    for root in range(ws):
        xs = [make_input(500 + root, r, 777, torch.float16) for r in range(ws)]
        gl = [torch.empty(777, dtype=torch.float16) for _ in range(ws)] if rank == root else None
        dist.gather(xs[rank], gather_list=gl, dst=root)
        if rank == root:
            for r in range(ws):
                assert_bitwise_equal(gl[r], xs[r], f"gather to {root} from {r}")
    # Object collectives.
    objs = [None] * ws
    dist.all_gather_object(objs, {"rank": rank, "data": list(range(rank + 1))})
    assert objs == [{"rank": r, "data": list(range(r + 1))} for r in range(ws)]
    lst = [f"hello-{ws}", 42] if rank == 0 else [None, None]
    dist.broadcast_object_list(lst, src=0)
    assert lst == [f"hello-{ws}", 42]
    return dist.group.WORLD._get_backend(torch.device("cpu")).single_copy_bytes


@pytest.mark.parametrize("mode", list(GATHER_MODES))
@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_gathers(ws, mode):
    offered = run_ranks(_gather_body, ws, env=GATHER_MODES[mode])
    if mode == "single-copy" and ws > 1:
        assert offered == [64] * ws, f"the group did not take the single-copy all_gather: {offered}"


def _scatter_body(rank, ws):
    for root in range(ws):
        blocks = [make_input(600 + root, r, 1500, torch.int16) for r in range(ws)]
        out = torch.empty(1500, dtype=torch.int16)
        dist.scatter(out, scatter_list=blocks if rank == root else None, src=root)
        assert_bitwise_equal(out, blocks[rank], f"scatter from {root}")
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.uint8):
        for op in (R.SUM, R.MIN) + ((R.AVG,) if dtype.is_floating_point else (R.BXOR,)):
            for numel in (1, 2500):
                # ins[r][p]: block that rank r contributes to rank p.
                ins = [[make_input(700 + p, r, numel, dtype) for p in range(ws)] for r in range(ws)]
                expected = fold([ins[r][rank] for r in range(ws)], op, dtype)
                out = torch.empty(numel, dtype=dtype)
                dist.reduce_scatter(out, [b.clone() for b in ins[rank]], op=op)
                assert_bitwise_equal(out, expected, f"reduce_scatter {dtype} {op}")
                out2 = torch.empty(numel, dtype=dtype)
                dist.reduce_scatter_tensor(out2, torch.cat(ins[rank]), op=op)
                assert_bitwise_equal(out2, expected, f"reduce_scatter_tensor {dtype} {op}")
    # Coalesced reduce_scatter_tensor.
    sizes = (4, 999)
    outs = [torch.empty(n) for n in sizes]
    with dist._coalescing_manager(async_ops=True) as cm:
        for o, n in zip(outs, sizes):
            dist.reduce_scatter_tensor(o, make_input(800 + n, rank, n * ws, torch.float32))
    cm.wait()
    for o, n in zip(outs, sizes):
        full = [make_input(800 + n, r, n * ws, torch.float32) for r in range(ws)]
        expected = fold([x[rank * n:(rank + 1) * n] for x in full], R.SUM, torch.float32)
        assert_bitwise_equal(o, expected, "coalesced reduce_scatter_tensor")
    # Complex reduce_scatter_tensor reduces the real views (through c10d and the direct op).
    cs = [torch.complex(make_input(810, r, 33 * ws, torch.float32), make_input(811, r, 33 * ws, torch.float32))
          for r in range(ws)]
    expected = fold([torch.view_as_real(x)[rank * 33:(rank + 1) * 33] for x in cs], R.SUM, torch.float32)
    co, co2 = torch.empty(33, dtype=torch.complex64), torch.empty(33, dtype=torch.complex64)
    dist.reduce_scatter_tensor(co, cs[rank])
    assert_bitwise_equal(torch.view_as_real(co), expected, "complex reduce_scatter_tensor")
    torch.ops.tdx.reduce_scatter_tensor_(co2, cs[rank])
    assert_bitwise_equal(torch.view_as_real(co2), expected, "complex reduce_scatter_tensor_")
    return True


@pytest.mark.parametrize("forced", [False, True], ids=["default", "forced-chunks"])
@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_scatters(ws, forced):
    run_ranks(_scatter_body, ws, env=FORCED_ENV if forced else None)


def _split(r, p, ws):
    """Rows rank r sends to rank p: uneven, with zeros."""
    return (r * 3 + p * 5 + ws) % 4


def _all_to_all_body(rank, ws):
    # Equal splits.
    inp = torch.arange(ws * 6, dtype=torch.float32) + 1000 * rank
    out = torch.empty(ws * 6)
    dist.all_to_all_single(out, inp)
    expected = torch.cat([torch.arange(rank * 6, rank * 6 + 6, dtype=torch.float32) + 1000 * r for r in range(ws)])
    assert_bitwise_equal(out, expected, "all_to_all_single, equal splits")
    # Uneven splits with zero-size blocks, 2-D rows.
    in_splits = [_split(rank, p, ws) for p in range(ws)]
    out_splits = [_split(r, rank, ws) for r in range(ws)]

    def rows(r, p):
        n = _split(r, p, ws)
        return torch.full((n, 3), float(r * 100 + p), dtype=torch.float64) + torch.arange(n * 3).reshape(n, 3)

    inp = torch.cat([rows(rank, p) for p in range(ws)])
    out = torch.empty(sum(out_splits), 3, dtype=torch.float64)
    dist.all_to_all_single(out, inp, output_split_sizes=out_splits, input_split_sizes=in_splits)
    assert_bitwise_equal(out, torch.cat([rows(r, rank) for r in range(ws)]), "all_to_all_single, uneven")
    # List form with tensors of different sizes.
    ins = [make_input(900 + p, rank, 10 + p + rank, torch.int64) for p in range(ws)]
    outs = [torch.empty(10 + rank + r, dtype=torch.int64) for r in range(ws)]
    dist.all_to_all(outs, ins)
    for r in range(ws):
        assert_bitwise_equal(outs[r], make_input(900 + rank, r, 10 + rank + r, torch.int64), f"all_to_all from {r}")
    return True


@pytest.mark.parametrize("forced", [False, True], ids=["default", "forced-chunks"])
@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_all_to_all(ws, forced):
    run_ranks(_all_to_all_body, ws, env=FORCED_ENV if forced else None)


def _subgroup_body(rank, ws):
    dist.barrier()
    evens = dist.new_group([r for r in range(ws) if r % 2 == 0])
    odds = dist.new_group([r for r in range(ws) if r % 2 == 1]) if ws > 1 else None
    mine = evens if rank % 2 == 0 else odds
    members = [r for r in range(ws) if r % 2 == rank % 2]
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mine)
    assert t.item() == float(sum(members))
    dist.broadcast(t, src=members[-1], group=mine)
    assert t.item() == float(sum(members))
    dist.barrier(group=mine)
    # The default group still works after subgroups were used.
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(ws)))
    return True


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_barrier_and_subgroups(ws):
    run_ranks(_subgroup_body, ws)


def _coalesced_gather_body(rank, ws):
    gloo = dist.new_group(backend="gloo")
    results = {}
    for n_inputs in sorted({1, ws, ws + 1}):
        inputs = [torch.arange(i + 1, dtype=torch.float32) + 10 * i + 100 * rank for i in range(n_inputs)]
        got = {}
        for name, group in (("tdx", None), ("gloo", gloo)):
            # torch's layout: outputs[p][i] receives input i of rank p.
            outputs = [[torch.full((i + 1,), -1.0) for i in range(n_inputs)] for _ in range(ws)]
            dist.all_gather_coalesced(outputs, inputs, group=group)
            got[name] = outputs
        results[n_inputs] = got
    return results


@pytest.mark.parametrize("ws", [2, 3])
def test_all_gather_coalesced_layout_matches_gloo(ws):
    """[rank][input] output layout, also when there are as many inputs as ranks."""
    for rank_results in run_ranks(_coalesced_gather_body, ws):
        for n_inputs, got in rank_results.items():
            expected = [[torch.arange(i + 1, dtype=torch.float32) + 10 * i + 100 * p for i in range(n_inputs)]
                        for p in range(ws)]
            for name in ("tdx", "gloo"):
                for p in range(ws):
                    for i in range(n_inputs):
                        assert torch.equal(got[name][p][i], expected[p][i]), (name, n_inputs, p, i)


def _aliased_all_reduce_body(rank, ws):
    gloo = dist.new_group(backend="gloo")
    results = {}
    for n in (1000, 4_000_001):  # within one shared-memory round, and over several
        got = {}
        for name, group in (("tdx", None), ("gloo", gloo)):
            x = torch.arange(n, dtype=torch.float32) + rank
            y = x.clone()
            # The same tensor twice, a view overlapping it, and a separate tensor: as Gloo does,
            # every entry is reduced from the caller's values and the results land in list order.
            dist.all_reduce_coalesced([x, x, x[n // 3: n // 2 + 1], y], group=group)
            got[name] = (x, y)
        results[n] = got
    return results


@pytest.mark.parametrize("ws", [2, 3])
def test_all_reduce_coalesced_with_aliased_inputs_matches_gloo(ws):
    """Inputs that share memory are not read after another entry overwrote them."""
    for rank_results in run_ranks(_aliased_all_reduce_body, ws):
        for n, got in rank_results.items():
            expected = (torch.arange(n, dtype=torch.float32) * ws + sum(range(ws)))
            for name in ("tdx", "gloo"):
                x, y = got[name]
                assert torch.equal(x, expected), (name, n)
                assert torch.equal(y, expected), (name, n)
