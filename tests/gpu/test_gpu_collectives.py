"""Every collective and p2p operation of tdx on CUDA tensors.

With one GPU per rank tdx runs them through NCCL, and each result must equal torch's own NCCL
backend bit for bit (a second process group on the same ranks). Where ranks share a GPU (2-4 ranks
on one GPU, the usual single-GPU machine) tdx stages through host memory, and each result must
equal tdx's CPU path on the same inputs (itself checked bit for bit against single-process
references by the CPU suite).
"""
import os

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from _reference import make_input

R = dist.ReduceOp
NCCL_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int32, torch.int64,
               torch.uint8]
NCCL_OPS = {True: [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX], False: [R.SUM, R.PRODUCT, R.MIN, R.MAX]}


def _gpus():
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _device(rank):
    torch.cuda.set_device(rank % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def _same(got, want, what):
    got, want = got.cpu(), want.cpu()
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    assert torch.equal(got.view(torch.uint8) if got.dtype != torch.bool else got,
                       want.view(torch.uint8) if want.dtype != torch.bool else want), what


def _cases(rank, world):
    """(name, fn(device, group) -> list of result tensors)."""
    cases = []
    n = 1000 + 37 * world

    def allreduce(dtype, op):
        def f(dev, group):
            x = make_input(1, rank, n, dtype, op).to(dev)
            dist.all_reduce(x, op=op, group=group)
            return [x]
        return f

    for dtype in NCCL_DTYPES:
        for op in NCCL_OPS[dtype.is_floating_point]:
            cases.append((f"all_reduce {dtype} {op}", allreduce(dtype, op), True))
    for dtype, op in [(torch.int16, R.SUM), (torch.bool, R.MAX), (torch.int32, R.BAND), (torch.int64, R.BXOR)]:
        cases.append((f"all_reduce {dtype} {op} (staged)", allreduce(dtype, op), False))

    def big_allreduce(dev, group):  # several MB: NCCL's ring path / tdx's chunked path
        x = make_input(2, rank, (8 << 20) // 4 + 3, torch.float32).to(dev)
        dist.all_reduce(x, group=group)
        return [x]
    cases.append(("all_reduce 8 MB", big_allreduce, True))

    def noncontig(dev, group):
        x = make_input(3, rank, 64 * 33, torch.float32).view(64, 33).to(dev)[:, 1:30]
        if group is None:  # tdx: in place on the strided view
            dist.all_reduce(x)
        else:  # the reference: torch's NCCL refuses non-contiguous tensors (torch 2.11)
            y = x.contiguous()
            dist.all_reduce(y, group=group)
            x.copy_(y)
        return [x.contiguous()]
    cases.append(("all_reduce non-contiguous", noncontig, True))

    def complex_sum(dev, group):
        x = torch.complex(make_input(4, rank, 300, torch.float32), make_input(5, rank, 300, torch.float32)).to(dev)
        dist.all_reduce(x, group=group)
        return [torch.view_as_real(x)]
    cases.append(("all_reduce complex64", complex_sum, True))

    def coalesced(dev, group):
        xs = [make_input(6 + i, rank, 100 * (i + 1), torch.float32).to(dev) for i in range(3)]
        with dist._coalescing_manager(group=group, device=dev):
            for x in xs:
                dist.all_reduce(x, group=group)
        torch.cuda.synchronize()
        return xs
    cases.append(("all_reduce coalesced", coalesced, True))

    for root in range(world):
        def bcast(dev, group, root=root):
            x = make_input(10, rank, n, torch.bfloat16).to(dev)
            dist.broadcast(x, src=root, group=group)
            return [x]

        def reduce(dev, group, root=root):
            x = make_input(11, rank, n, torch.float32).to(dev)
            dist.reduce(x, dst=root, group=group)
            return [x] if rank == root else []

        def gather(dev, group, root=root):
            x = make_input(12, rank, n, torch.int32).to(dev)
            out = [torch.empty_like(x) for _ in range(world)] if rank == root else None
            dist.gather(x, out, dst=root, group=group)
            return out or []

        def scatter(dev, group, root=root):
            ins = [make_input(13, p, n, torch.float16).to(dev) for p in range(world)] if rank == root else None
            out = torch.empty(n, dtype=torch.float16, device=dev)
            dist.scatter(out, ins, src=root, group=group)
            return [out]
        cases += [(f"broadcast root {root}", bcast, True), (f"reduce root {root}", reduce, True),
                  (f"gather root {root}", gather, True), (f"scatter root {root}", scatter, True)]

    def all_gather(dev, group):
        x = make_input(14, rank, n, torch.float64).to(dev)
        out = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(out, x, group=group)
        return out

    def all_gather_into(dev, group):
        x = make_input(15, rank, n, torch.int8).to(dev)
        out = torch.empty(world * n, dtype=torch.int8, device=dev)
        dist.all_gather_into_tensor(out, x, group=group)
        return [out]

    def reduce_scatter(dev, group):
        ins = [make_input(16, rank * world + p, n, torch.float32).to(dev) for p in range(world)]
        out = torch.empty(n, device=dev)
        dist.reduce_scatter(out, ins, group=group)
        return [out]

    def reduce_scatter_tensor(dev, group):
        x = make_input(17, rank, world * n, torch.bfloat16).to(dev)
        out = torch.empty(n, dtype=torch.bfloat16, device=dev)
        dist.reduce_scatter_tensor(out, x, op=R.AVG, group=group)
        return [out]

    def all_to_all_single(dev, group):
        ins_split = [(rank + p) % 3 + 1 for p in range(world)]
        outs_split = [(p + rank) % 3 + 1 for p in range(world)]
        x = make_input(18, rank, sum(ins_split) * 5, torch.float32).view(-1, 5).to(dev)
        out = torch.empty(sum(outs_split), 5, device=dev)
        dist.all_to_all_single(out, x, outs_split, ins_split, group=group)
        return [out]

    def all_to_all(dev, group):
        ins = [make_input(19, rank * world + p, 50 + p, torch.int64).to(dev) for p in range(world)]
        outs = [torch.empty(50 + rank, dtype=torch.int64, device=dev) for _ in range(world)]
        dist.all_to_all(outs, ins, group=group)
        return outs

    def p2p_ring(dev, group):
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        x = make_input(20, rank, 5000, torch.float32).to(dev)
        out = torch.empty_like(x)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, nxt, group), dist.P2POp(dist.irecv, out, prv, group)])
        for r in reqs:
            r.wait()
        return [out]

    def send_recv(dev, group):
        x = make_input(21, rank, 777, torch.float16).to(dev)
        if rank == 0:
            for p in range(1, world):
                dist.send(x, p, group=group)
            return []
        dist.recv(x, 0, group=group)
        return [x]

    cases += [("all_gather", all_gather, True), ("all_gather_into_tensor", all_gather_into, True),
              ("reduce_scatter", reduce_scatter, True), ("reduce_scatter_tensor AVG", reduce_scatter_tensor, True),
              ("all_to_all_single uneven", all_to_all_single, True), ("all_to_all", all_to_all, True)]
    if world > 1:
        cases += [("batch_isend_irecv ring", p2p_ring, True), ("send/recv", send_recv, True)]
    return cases


def _collectives_body(rank, world, compare_nccl):
    dev = _device(rank)
    nccl = dist.new_group(backend="nccl") if compare_nccl else None
    checked = []
    for name, fn, nccl_can in _cases(rank, world):
        got = fn(dev, None)
        torch.cuda.synchronize()
        if compare_nccl and nccl_can:
            want = fn(dev, nccl)
            torch.cuda.synchronize()
            ref = "torch nccl"
        else:
            want = fn(torch.device("cpu"), None)
            ref = "tdx cpu"
        assert len(got) == len(want), name
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, f"{name} [{i}] vs {ref}")
        checked.append(name)
    dist.barrier()
    return checked


def test_every_collective_world1_vs_torch_nccl():
    """World size 1: tdx takes its NCCL path; every result equals torch's NCCL backend."""
    checked = run_ranks(_collectives_body, 1, True, backend="tdx", timeout=600)
    assert "all_reduce 8 MB" in checked[0]


@pytest.mark.parametrize("world", [2, 4])
def test_every_collective_one_gpu_per_rank_vs_torch_nccl(world):
    if _gpus() < world:
        pytest.skip(f"needs {world} GPUs, this machine has {_gpus()}")
    run_ranks(_collectives_body, world, True, backend="tdx", timeout=600)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_collective_ranks_sharing_one_gpu(world):
    """2-4 ranks on one GPU (NCCL refuses them): tdx stages through host memory."""
    run_ranks(_collectives_body, world, False, backend="tdx", timeout=600,
              env={"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]})


def _forced_nccl_body(rank, world):
    _device(rank)
    try:
        dist.all_reduce(torch.ones(4, device="cuda"))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_forcing_nccl_on_a_shared_gpu_explains_itself():
    msgs = run_ranks(_forced_nccl_body, 2, backend="tdx", env={"TDX_CUDA_PATH": "nccl", "CUDA_VISIBLE_DEVICES": "0"})
    for m in msgs:
        assert "Duplicate GPU detected" in m and "share GPU" in m, m


def _mixed_devices_body(rank, world):
    _device(rank)
    out = torch.empty(2 * world, device="cuda")
    try:
        dist.all_gather_into_tensor(out, torch.ones(2))
    except (ValueError, RuntimeError) as e:
        return str(e)
    return "no error"


def test_mixing_cpu_and_cuda_in_one_call_is_refused():
    for m in run_ranks(_mixed_devices_body, 1, backend="tdx"):
        assert "different devices" in m, m


def _staged_timeout_body(rank, world):
    _device(rank)
    if rank == 1:
        return "skipped"
    try:
        dist.all_reduce(torch.ones(8, device="cuda"))
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_staged_path_timeout_names_the_missing_rank():
    msgs = run_ranks(_staged_timeout_body, 2, backend="tdx", pg_timeout=3.0, env={"CUDA_VISIBLE_DEVICES": "0"})
    assert "all_reduce (sequence" in msgs[0] and "did not arrive" in msgs[0], msgs[0]


def _nccl_timeout_body(rank, world):
    _device(rank)
    dist.all_reduce(torch.ones(8, device="cuda"))  # creates the communicator on both ranks
    torch.cuda.synchronize()
    if rank == 1:
        return "skipped"
    w = dist.all_reduce(torch.ones(8, device="cuda"), async_op=True)
    import time

    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if w.is_completed():
                return "completed?"
        except RuntimeError as e:
            return str(e)
        time.sleep(0.1)
    return "no error"


def test_nccl_path_timeout_names_op_sequence_and_missing_rank():
    if _gpus() < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {_gpus()}")
    msgs = run_ranks(_nccl_timeout_body, 2, backend="tdx", pg_timeout=5.0)
    assert "all_reduce (sequence" in msgs[0] and "timed out" in msgs[0] and "[1]" in msgs[0], msgs[0]
