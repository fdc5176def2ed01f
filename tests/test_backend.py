"""Registration, the ways to initialize "tdx", torch's own DDP on tdx, and its errors."""
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from _reference import expect_raises

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_registers_once():
    import importlib

    import torchdist_ext

    assert "tdx" in dist.Backend.backend_list
    importlib.reload(torchdist_ext)  # a second import must not raise
    torchdist_ext.register()
    assert dist.Backend.backend_list.count("tdx") == 1
    assert dist.Backend("tdx") == "tdx"


def _explicit_store_body(rank, ws, kind, path_or_port):
    import torchdist_ext  # noqa: F401

    if kind == "file":
        store = dist.FileStore(path_or_port, ws)
    else:
        store = dist.TCPStore("127.0.0.1", path_or_port, ws, is_master=rank == 0, timeout=timedelta(seconds=30))
    dist.init_process_group("tdx", store=store, rank=rank, world_size=ws)
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t)
    assert torch.all(t == ws * (ws + 1) / 2)
    assert dist.get_backend() == "tdx"
    dist.destroy_process_group()
    return True


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_file_store(tmp_path):
    run_ranks(_explicit_store_body, 2, "file", str(tmp_path / "store"), backend=None)


def test_tcp_store():
    run_ranks(_explicit_store_body, 3, "tcp", _free_port(), backend=None)


def _device_map_body(rank, ws):
    t = torch.arange(4, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(t)
    assert torch.equal(t, torch.arange(4, dtype=torch.float32) * ws * (ws + 1) / 2)
    assert type(dist.group.WORLD._get_backend(torch.device("cpu"))).__name__ == "TdxBackend"
    return True


def test_device_mapped_backend_string():
    # The CPU build of torch has no NCCL, so the CUDA half of the mapping is gloo here;
    # "cpu:tdx,cuda:nccl" is exercised by tests/gpu.
    run_ranks(_device_map_body, 2, backend="cpu:tdx,cuda:gloo")


def test_torchrun_demo():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           os.path.join(REPO, "examples", "collectives_demo.py"), "--max-numel", "100000"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all collectives matched the reference" in proc.stdout


def _torch_ddp_body(rank, ws, steps):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 3))
    ddp = DDP(model, bucket_cap_mb=0.01)  # several buckets
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x = torch.randn(16, 20, generator=g)
        y = torch.randint(0, 3, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("ws", [2, 3])
def test_torch_ddp_on_tdx_matches_gloo(ws):
    tdx = run_ranks(_torch_ddp_body, ws, 8, backend="tdx")
    gloo = run_ranks(_torch_ddp_body, ws, 8, backend="gloo")
    for r in range(ws):
        for a, b in zip(tdx[r], tdx[0]):
            assert torch.equal(a, b), "replicas drifted apart on tdx"
    for a, b in zip(tdx[0], gloo[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _bad_input_body(rank, ws):
    expect = expect_raises
    expect(ValueError, "root rank 5 is out of range",
           lambda: dist.group.WORLD.broadcast(torch.ones(2), 5))
    expect(ValueError, "BXOR is a bitwise op", lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BXOR))
    expect(ValueError, "AVG needs a floating-point", lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32),
                                                                            op=dist.ReduceOp.AVG))
    # torch checks some inputs itself; call the process group directly to reach tdx's checks.
    pg = dist.group.WORLD
    expect(TypeError, "mix dtypes", lambda: pg.allgather([[torch.ones(2), torch.ones(2, dtype=torch.float64)]],
                                                         [torch.ones(2)]))
    expect(ValueError, "must have world size", lambda: dist.all_gather_into_tensor(torch.empty(3), torch.ones(2)))
    expect(ValueError, "must have world size", lambda: dist.reduce_scatter_tensor(torch.empty(2), torch.ones(3)))
    expect(ValueError, "split sizes sum to", lambda: dist.all_to_all_single(
        torch.empty(4), torch.ones(4), output_split_sizes=[3, 3], input_split_sizes=[2, 2]))
    expect(ValueError, "output list has 3 tensors", lambda: dist.all_gather([torch.empty(2)] * 3, torch.ones(2)))
    # The group still works after refused calls (nothing was started).
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.all(t == ws)
    return True


def test_bad_inputs_raise_clear_errors():
    run_ranks(_bad_input_body, 2)


def _late_rank_body(rank, ws):
    if rank == 1:
        time.sleep(6)  # never joins the all_reduce
        return None
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(10))
    except dist.DistBackendError as e:
        return str(e), time.monotonic() - start
    raise AssertionError("all_reduce without rank 1 did not fail")


def test_timeout_names_op_sequence_and_missing_rank():
    results = run_ranks(_late_rank_body, 2, pg_timeout=2.0)
    msg, elapsed = results[0]
    assert "all_reduce (sequence 1)" in msg and "ranks [1] did not arrive" in msg, msg
    assert 1.9 <= elapsed < 4.0, f"failed after {elapsed:.1f} s with a 2 s timeout"


def _mismatch_body(rank, ws):
    try:
        dist.all_reduce(torch.ones(10 + rank))
    except dist.DistBackendError as e:
        return str(e)
    raise AssertionError("mismatched all_reduce sizes were not detected")


def test_mismatched_sizes_detected_on_every_rank():
    msgs = run_ranks(_mismatch_body, 2, pg_timeout=10.0)
    for m in msgs:
        assert "mismatched collectives" in m and "bytes" in m, m


def _released_when_wait_returns(rank, ws):
    import weakref

    dead = []
    for i in range(200):
        inp = torch.full((ws * (1 << 16),), float(rank + i))
        out = torch.empty(1 << 16)
        alive = weakref.ref(inp)
        work = dist.reduce_scatter_tensor(out, inp, async_op=True)
        del inp  # only the backend still holds the input
        work.wait()
        dead.append(alive() is None)  # at once: no sleep, no gc, nothing that yields the core
    return dead


def test_a_collective_releases_its_input_before_wait_returns():
    # FSDP frees a unit's full gradient right after its reduce-scatter's wait(): the backend's
    # worker thread must not keep it alive until it next gets a core.
    for rank, dead in enumerate(run_ranks(_released_when_wait_returns, 2)):
        assert all(dead), f"rank {rank}: the input was still alive after wait() in {dead.count(False)} of 200 calls"
