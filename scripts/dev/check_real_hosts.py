"""The multi-host checks of tests/test_hosts.py at layouts larger than the tests' four ranks:
H test hosts x L ranks under torchrun --nnodes=H (tests/_testhosts.py), 1 Gbit/s links.

    python scripts/dev/check_real_hosts.py --hosts 8 --nproc-per-node 2 [--check collectives,train,cut,kill]

- collectives: every collective and p2p op against the single-process reference, bit-identical on
  every rank (tests/test_multihost.py's body); nothing left in any /dev/shm.
- train: our DDP, FSDP stage 3 and a pp=2 pipeline across the hosts against the same job on one
  host (H x L ranks there; both need an even world size for the pipeline).
- cut: the last host's link down past the group timeout (15 s): every rank raises within the
  timeout + 5 s, in one readable sentence; the others name the cut host alone (with 3 hosts or more).
- kill: every process on the last host killed: every other rank raises within 2 s, naming that
  host and its ranks, in one readable sentence.

Exits non-zero on the first check that fails. Needs root (network namespaces); the ranks share
this machine's cores, so large layouts run slowly (16 hosts x 1 rank: about a minute on 2 cores).
"""
import argparse
import pathlib
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent.parent  # scripts/
sys.path[:0] = [str(HERE.parent / "tests"), str(HERE.parent)]


def _collectives(H, L):
    from _reference import assert_bitwise_equal
    from test_hosts import assert_no_shm_left, collect, start_job
    from _testhosts import TestHosts

    with tempfile.TemporaryDirectory() as tmp, TestHosts(H, rate="1gbit") as hosts:
        tmp = pathlib.Path(tmp)
        out, procs = start_job(hosts, tmp, "test_multihost:_body", nproc_per_node=L, pg_timeout=300)
        runs = collect(hosts, tmp, out, procs, world_size=H * L, timeout=1500)
        for key, value in runs[0]["result"].items():
            for r in range(1, H * L):
                assert_bitwise_equal(runs[r]["result"][key], value, f"{key}: rank {r} differs from rank 0")
        assert_no_shm_left(hosts)


def _training(H, L):
    from _dist import run_ranks
    from test_hosts import _train, assert_no_shm_left, collect, compare_training, start_job
    from _testhosts import TestHosts

    ws = H * L
    with tempfile.TemporaryDirectory() as tmp, TestHosts(H, rate="1gbit") as hosts:
        tmp = pathlib.Path(tmp)
        out, procs = start_job(hosts, tmp, "test_hosts:_train", nproc_per_node=L, pg_timeout=300)
        runs = [r["result"] for r in collect(hosts, tmp, out, procs, world_size=ws, timeout=1500)]
        assert_no_shm_left(hosts)
    compare_training(runs, run_ranks(_train, ws, timeout=1500))  # against the same job on one host


def _cut(H, L):
    from test_hosts import FAULT_TIMEOUT, MARGIN, _check_readable, run_until_fault
    from _testhosts import TestHosts

    ws = H * L
    with tempfile.TemporaryDirectory() as tmp, TestHosts(H) as hosts:
        victim = hosts.hosts[-1].name
        cut, runs = run_until_fault(hosts, pathlib.Path(tmp), lambda: hosts.set_link(victim, up=False), ws, ws, L,
                                    FAULT_TIMEOUT + 40, restore=lambda: hosts.set_link(victim, up=True))
    for r, run in enumerate(runs):
        msg, host, took = run["result"]["error"], run["host"], run["result"]["time"] - cut
        print(f"  rank {r} on {host}, {took:.1f} s after the cut: {msg}")
    for r, run in enumerate(runs):
        msg, host, took = run["result"]["error"], run["host"], run["result"]["time"] - cut
        assert msg is not None and took <= FAULT_TIMEOUT + MARGIN, f"rank {r} on {host} did not raise in time"
        _check_readable(msg)
        named = msg.split(" within ")[0]
        if host != victim and H > 2:
            assert f"no answer from host '{victim}'" in named and " and host " not in named, msg


def _kill(H, L):
    from test_hosts import FAULT_TIMEOUT, _check_readable, run_until_fault
    from _testhosts import TestHosts

    ws = H * L
    with tempfile.TemporaryDirectory() as tmp, TestHosts(H) as hosts:
        victim = hosts.hosts[-1].name
        killed, runs = run_until_fault(hosts, pathlib.Path(tmp), lambda: hosts.kill(victim), ws, ws - L, L,
                                       FAULT_TIMEOUT + 20)
    dead = list(range(ws - L, ws))
    for r, run in enumerate(runs):
        msg, took = run["result"]["error"], run["result"]["time"] - killed
        print(f"  rank {r} on {run['host']}, {took:.1f} s after {victim} was killed: {msg}")
    for r, run in enumerate(runs):
        msg, took = run["result"]["error"], run["result"]["time"] - killed
        assert msg is not None and took <= 2.0, f"rank {r} did not raise within 2 s"
        assert f"host '{victim}' (ranks {dead}) closed the connection" in msg, msg
        _check_readable(msg)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--nproc-per-node", type=int, default=2)
    p.add_argument("--check", default="collectives,train,cut,kill",
                   help="comma list of collectives, train, cut, kill")
    args = p.parse_args()
    from _testhosts import unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"check_real_hosts: {reason}")
    checks = {"collectives": _collectives, "train": _training, "cut": _cut, "kill": _kill}
    if "train" in args.check.split(",") and args.hosts * args.nproc_per_node % 2:
        raise SystemExit("check_real_hosts: the train check runs a pp=2 pipeline: give it an even number of ranks")
    for name in args.check.split(","):
        if name not in checks:
            raise SystemExit(f"check_real_hosts: unknown check {name!r}; choose from {', '.join(checks)}")
        t0 = time.time()
        checks[name](args.hosts, args.nproc_per_node)
        print(f"OK {name}: {args.hosts} hosts x {args.nproc_per_node} ranks in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
