"""tdx across real hosts: 2 test hosts x 2 ranks under torchrun --nnodes=2 (tests/_testhosts.py).

Each host has its own network namespace, hostname, IPC and mount namespaces and a private
/dev/shm; the hosts meet through c10d rendezvous on hostA's address. Results come back through
files (tests/_hostjob.py). Skips with the reason where namespaces cannot be made.
"""
import glob
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from _dist import run_ranks
from _reference import assert_bitwise_equal
from _testhosts import TestHosts, unavailable_reason

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


@pytest.fixture(scope="module")
def hosts():
    with TestHosts(2) as h:
        yield h


def start_job(hosts, tmp_path, target, *args, pg_timeout=60, env=None, nproc_per_node=2):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    job_env = {"PYTHONPATH": os.pathsep.join([REPO, HERE]), "TDX_TEST_PG_TIMEOUT": pg_timeout,
               "OMP_NUM_THREADS": 1, **(env or {})}
    procs = hosts.torchrun([os.path.join(HERE, "_hostjob.py"), str(out), target, *map(str, args)],
                           nproc_per_node=nproc_per_node, env=job_env, log_dir=str(tmp_path))
    return out, procs


def collect(hosts, tmp_path, out, procs, world_size=4, timeout=240, wait_exit=True):
    """Per-rank {"host", "result"}; fails with every rank's traceback and the hosts' logs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = glob.glob(str(out / "rank*.pt")) + glob.glob(str(out / "rank*.err"))
        if len(done) >= world_size or all(p.poll() is not None for p in procs):
            break
        time.sleep(0.2)
    if wait_exit:
        hosts.wait(procs, timeout=max(5.0, deadline - time.monotonic()))
    errors = {p: open(p).read() for p in sorted(glob.glob(str(out / "rank*.err")))}
    results = {}
    for r in range(world_size):
        path = out / f"rank{r}.pt"
        if path.exists():
            results[r] = torch.load(path, weights_only=False)
    if errors or len(results) < world_size:
        logs = "\n".join(f"--- {p} ---\n{open(p).read()[-4000:]}" for p in sorted(glob.glob(str(tmp_path / "host*.log"))))
        pytest.fail(f"{len(results)} of {world_size} ranks returned results\n" + "\n".join(errors.values()) + logs)
    return [results[r] for r in range(world_size)]


def assert_no_shm_left(hosts):
    for h in hosts.hosts:
        left = hosts.shm_files(h.index)
        assert not left, f"{h.name}'s /dev/shm still holds {left}"


# ---------------------------------------------------------------- every collective and p2p op


def test_collectives_and_p2p_across_real_hosts(hosts, tmp_path):
    """test_multihost's body (every collective against the single-process reference, p2p) on real hosts."""
    out, procs = start_job(hosts, tmp_path, "test_multihost:_body")
    runs = collect(hosts, tmp_path, out, procs)
    assert sorted({r["host"] for r in runs}) == ["hostA", "hostB"]
    for key, value in runs[0]["result"].items():
        for r in range(1, 4):
            assert_bitwise_equal(runs[r]["result"][key], value, f"{key}: rank {r} differs from rank 0")
    assert_no_shm_left(hosts)


@pytest.mark.parametrize("n_hosts", [3, 4])
def test_real_hosts_one_rank_each(tmp_path, n_hosts):
    """3 and 4 hosts x 1 rank (torchrun --nnodes=N) on 1 Gbit/s links: every collective and p2p op
    against the single-process reference, bit-identical on every rank; nothing left in any /dev/shm."""
    with TestHosts(n_hosts, rate="1gbit") as hosts:
        out, procs = start_job(hosts, tmp_path, "test_multihost:_body", nproc_per_node=1)
        runs = collect(hosts, tmp_path, out, procs, world_size=n_hosts)
        assert sorted(r["host"] for r in runs) == ["hostA", "hostB", "hostC", "hostD"][:n_hosts]
        for key, value in runs[0]["result"].items():
            for r in range(1, n_hosts):
                assert_bitwise_equal(runs[r]["result"][key], value, f"{key}: rank {r} differs from rank 0")
        assert_no_shm_left(hosts)


# ---------------------------------------------------------------- training across hosts


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return torch.tanh(self.fc(x))


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), Block(16), Block(16), nn.Linear(16, 3))


def _batches(rank, steps=4, per_rank=8):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(per_rank, 12, generator=g), torch.randint(0, 3, (per_rank,), generator=g)) for _ in range(steps)]


def _train(rank, ws):
    """Our DDP, FSDP stage 3 and a pp=2 x dp=2 pipeline, a few SGD steps each; final parameters."""
    import torchdist_ext
    from torchdist_ext.pipeline import PipelineStage, Schedule1F1B

    loss_fn = nn.functional.cross_entropy
    out = {}
    ddp = torchdist_ext.DistributedDataParallel(_model(), bucket_cap_mb=0.001)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for x, y in _batches(rank):
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        opt.step()
    out["ddp"] = [p.detach().clone() for p in ddp.module.parameters()]

    fsdp = torchdist_ext.FullyShardedDataParallel(_model(), stage=3,
                                                  auto_wrap_policy=torchdist_ext.ModuleWrapPolicy({Block}))
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    for x, y in _batches(rank):
        opt.zero_grad()
        loss_fn(fsdp(x), y).backward()
        opt.step()
    sd = torchdist_ext.full_state_dict(fsdp)
    out["fsdp3"] = {k: v.clone() for k, v in sd.items()} if rank == 0 else None

    pp = 2
    replica, stage_idx = divmod(rank, pp)
    pp_groups = [dist.new_group(list(range(r * pp, (r + 1) * pp))) for r in range(ws // pp)]
    dp_groups = [dist.new_group(list(range(s, ws, pp))) for s in range(pp)]
    full = _model()
    part = full[:2] if stage_idx == 0 else full[2:]
    module = torchdist_ext.DistributedDataParallel(part, process_group=dp_groups[stage_idx])
    stage = PipelineStage(module, stage_idx, pp, "cpu", group=pp_groups[replica])
    sched = Schedule1F1B(stage, 2, loss_fn=loss_fn)
    opt = torch.optim.SGD(part.parameters(), lr=0.1)
    for x, y in _batches(100 + replica):
        opt.zero_grad()
        if stage_idx == 0:
            sched.step(x)
        else:
            sched.step(target=y)
        opt.step()
    out["pipe"] = [p.detach().clone() for p in part.parameters()]
    return out


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=what)


def compare_training(runs, ref):
    """_train's results across hosts (`runs`) against the same job on one host (`ref`), by rank."""
    for r in range(len(runs)):
        for i, (a, b) in enumerate(zip(runs[r]["ddp"], ref[r]["ddp"])):
            _close(a, b, f"DDP parameter {i}, rank {r}")
            assert_bitwise_equal(a, runs[0]["ddp"][i], f"DDP parameter {i}: rank {r} differs from rank 0")
        for i, (a, b) in enumerate(zip(runs[r]["pipe"], ref[r]["pipe"])):
            _close(a, b, f"pipeline parameter {i}, rank {r}")
    for k, v in ref[0]["fsdp3"].items():
        _close(runs[0]["fsdp3"][k], v, f"FSDP stage 3 {k}")


def test_training_across_real_hosts_matches_one_host(hosts, tmp_path):
    out, procs = start_job(hosts, tmp_path, "test_hosts:_train")
    runs = [r["result"] for r in collect(hosts, tmp_path, out, procs)]
    compare_training(runs, run_ranks(_train, 4))  # against the same job on one host
    assert_no_shm_left(hosts)


# ---------------------------------------------------------------- failures: no wait past the timeout

FAULT_TIMEOUT = 15.0  # the group timeout of the failure tests, seconds
MARGIN = 5.0


def _until_failure(rank, ws, ready_dir, limit="120"):
    """all_reduce in a loop until one raises; returns the message, the time it raised and the op count."""
    x = torch.ones(1 << 16)
    dist.barrier()
    open(os.path.join(ready_dir, f"ready{rank}"), "w").close()
    start, count = time.time(), 0
    while time.time() - start < float(limit):
        try:
            x.fill_(1.0)
            dist.all_reduce(x)
            count += 1
        except Exception as e:  # noqa: BLE001 - the failure under test
            return {"error": str(e), "time": time.time(), "count": count}
        time.sleep(0.01)
    return {"error": None, "time": time.time(), "count": count}


def _wait_ready(tmp_path, procs, n=4, timeout=120):
    deadline = time.monotonic() + timeout
    while len(glob.glob(str(tmp_path / "ready*"))) < n:
        assert time.monotonic() < deadline, "the ranks did not get ready"
        assert any(p.poll() is None for p in procs), "the jobs exited before getting ready"
        time.sleep(0.05)


def _check_readable(msg):
    assert "frame #" not in msg and "Exception raised from" not in msg, f"C++ stack dump in the error:\n{msg}"
    assert len(msg.splitlines()) <= 2, f"the error is not one readable sentence:\n{msg}"


def run_until_fault(hosts, tmp_path, fault, ranks, answering, nproc_per_node, timeout, restore=None):
    """_until_failure on every rank of `hosts`; once all `ranks` are ready, `fault()` (and `restore()`
    after). Returns the time of the fault and the results of ranks [0, answering)."""
    out, procs = start_job(hosts, tmp_path, "test_hosts:_until_failure", tmp_path, pg_timeout=FAULT_TIMEOUT,
                           nproc_per_node=nproc_per_node)
    try:
        _wait_ready(tmp_path, procs, n=ranks)
        time.sleep(0.5)
        at = time.time()
        fault()
        runs = collect(hosts, tmp_path, out, procs, world_size=answering, timeout=timeout, wait_exit=False)
    finally:
        if restore:
            restore()
        hosts.kill()
    return at, runs


def test_link_down_longer_than_the_timeout_every_rank_raises_in_time(hosts, tmp_path):
    out, procs = start_job(hosts, tmp_path, "test_hosts:_until_failure", tmp_path, pg_timeout=FAULT_TIMEOUT)
    try:
        _wait_ready(tmp_path, procs)
        time.sleep(0.5)
        cut = time.time()
        hosts.set_link("hostB", up=False)
        runs = collect(hosts, tmp_path, out, procs, timeout=FAULT_TIMEOUT + 40, wait_exit=False)
    finally:
        hosts.set_link("hostB", up=True)
        hosts.kill()
    for r, run in enumerate(runs):
        res, host = run["result"], run["host"]
        msg = res["error"]
        assert msg is not None, f"rank {r} never raised"
        took = res["time"] - cut
        assert took <= FAULT_TIMEOUT + MARGIN, f"rank {r} on {host} raised {took:.1f} s after the cut: {msg}"
        assert "all_reduce (sequence " in msg, msg
        other = "hostB" if host == "hostA" else "hostA"
        peers = [q for q in range(4) if runs[q]["host"] == other]
        assert other in msg and str(peers) in msg, f"rank {r} on {host} does not name {other} {peers}: {msg}"
        _check_readable(msg)


def test_one_host_of_three_cut_off_the_others_name_only_it(tmp_path):
    """3 hosts x 1 rank, hostC's link down past the timeout: every rank raises in time; hostA and
    hostB, which still reach each other and the store, name hostC alone; hostC names both others."""
    with TestHosts(3) as hosts:
        cut, runs = run_until_fault(hosts, tmp_path, lambda: hosts.set_link("hostC", up=False), 3, 3, 1,
                                    FAULT_TIMEOUT + 40, restore=lambda: hosts.set_link("hostC", up=True))
    for r, run in enumerate(runs):
        msg, host = run["result"]["error"], run["host"]
        assert msg is not None, f"rank {r} never raised"
        took = run["result"]["time"] - cut
        assert took <= FAULT_TIMEOUT + MARGIN, f"rank {r} on {host} raised {took:.1f} s after the cut: {msg}"
        assert "all_reduce (sequence " in msg, msg
        named = msg.split(" within ")[0]
        if host == "hostC":
            assert "host 'hostA' (ranks [0])" in named and "host 'hostB' (ranks [1])" in named, msg
        else:
            other = "hostB" if host == "hostA" else "hostA"
            assert "no answer from host 'hostC' (ranks [2])" in named and other not in named, msg
            assert f"host '{other}' (ranks [{1 - r}]) timed out on it too" in msg, msg
        _check_readable(msg)


def test_host_killed_the_other_host_raises_on_the_closed_connection_naming_its_ranks(hosts, tmp_path):
    """hostB's ranks SIGKILLed: hostA's ranks raise from the closed connections (not at the group
    timeout), naming the operation, its sequence number, hostB and its ranks (a rank that learnt it
    from its host mate quotes the host mate's error)."""
    out, procs = start_job(hosts, tmp_path, "test_hosts:_until_failure", tmp_path, pg_timeout=FAULT_TIMEOUT)
    try:
        _wait_ready(tmp_path, procs)
        time.sleep(0.5)
        victim = "hostB"
        hosts.kill(victim)
        deadline = time.monotonic() + FAULT_TIMEOUT + 20
        while len(glob.glob(str(out / "rank*.pt"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        runs = {}
        for path in glob.glob(str(out / "rank*.pt")):
            r = int(os.path.basename(path)[4:-3])
            runs[r] = torch.load(path, weights_only=False)
    finally:
        hosts.kill()
    survivors = {r: run for r, run in runs.items() if run["host"] != victim}
    assert len(survivors) == 2, f"results from {sorted(runs)}; logs in {tmp_path}"
    dead = sorted(set(range(4)) - set(survivors))
    for r, run in survivors.items():
        msg = run["result"]["error"]
        assert msg is not None, f"rank {r} never raised"
        assert "all_reduce (sequence " in msg, msg
        assert f"host '{victim}' (ranks {dead}) closed the connection" in msg, \
            f"rank {r} did not raise on {victim}'s closed connections: {msg}"
        _check_readable(msg)


def test_one_host_of_three_killed_the_others_name_it_on_the_closed_connection(tmp_path):
    """3 hosts x 1 rank, hostC killed: hostA's and hostB's ranks raise from the closed connection (not
    at the group timeout) naming hostC, by the address Gloo gives (or, where a rank saw the failure
    passed on by the other survivor, quoting it)."""
    with TestHosts(3) as hosts:
        _, runs = run_until_fault(hosts, tmp_path, lambda: hosts.kill("hostC"), 3, 2, 1, FAULT_TIMEOUT + 20)
    for r, run in enumerate(runs):
        msg = run["result"]["error"]
        assert msg is not None, f"rank {r} never raised"
        assert "all_reduce (sequence " in msg, msg
        assert "host 'hostC' (ranks [2]) closed the connection: ranks there exited" in msg, msg
        _check_readable(msg)


def _train_through_flap(rank, ws, flag_dir):
    """DDP steps until the test has cut the link and restored it (flag file), then 5 more."""
    import torchdist_ext

    ddp = torchdist_ext.DistributedDataParallel(_model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    steps, after = 0, 0
    while after < 5:
        restored = torch.tensor([float(os.path.exists(os.path.join(flag_dir, "restored")))])
        dist.all_reduce(restored, op=dist.ReduceOp.MIN)  # every rank counts the same steps
        after += int(restored.item())
        x, y = torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        steps += 1
        if steps == 3:
            open(os.path.join(flag_dir, f"ready{rank}"), "w").close()
        time.sleep(0.05)
        assert steps < 5000, "the link was never restored"
    return {"params": [p.detach().clone() for p in ddp.module.parameters()], "steps": steps}


def test_link_flap_shorter_than_the_timeout_training_goes_on(hosts, tmp_path):
    out, procs = start_job(hosts, tmp_path, "test_hosts:_train_through_flap", tmp_path, pg_timeout=30)
    try:
        _wait_ready(tmp_path, procs)
        hosts.set_link("hostB", up=False)
        time.sleep(4.0)
        hosts.set_link("hostB", up=True)
        open(tmp_path / "restored", "w").close()
        runs = collect(hosts, tmp_path, out, procs, timeout=120)
    finally:
        hosts.set_link("hostB", up=True)
        hosts.kill()
    for r in range(1, 4):
        assert runs[r]["result"]["steps"] == runs[0]["result"]["steps"]
        for i, (a, b) in enumerate(zip(runs[r]["result"]["params"], runs[0]["result"]["params"])):
            assert_bitwise_equal(a, b, f"parameter {i}: rank {r} differs from rank 0 after the flap")


def test_bench_hosts_cli_prints_every_collective_with_its_link_bound():
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "torchdist_ext.bench", "hosts", "--hosts", "2", "--link", "1gbit",
                           "--sizes", "64K", "--repeats", "1", "--iters", "1", "-c", "all"],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for coll in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce"):
        assert f"# {coll}: 2 hosts x 2 ranks, link 1gbit" in proc.stdout, proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.strip().startswith("64K")]
    assert len(rows) == 5 and not any("WRONG" in r for r in rows), proc.stdout
    assert all(r.rstrip().endswith("p90") and "%" in r for r in rows), proc.stdout
