"""Elastic recovery figures (a benchmark, not a test; prints a table, asserts nothing on time).

1. Failure notice: the time from a victim rank's failure (sys.exit(3) inside an except block, as
   torch.multiprocessing does; SIGTERM) to the moment a peer blocked in all_reduce raises, with the
   notice on and, as the anchor of the same run, off (TDX_FAILURE_NOTICE=0: peers learn of the
   failure only once the process has died). Interleaved rounds, median and p90.
2. ElasticDDP: the time from SIGKILL of 1 of 4 ranks to the survivors' next completed step, beside
   the median step time of the same run.
3. With --compare-restart: the wall time a SIGKILL costs examples/train_ddp.py under torchrun
   --max-restarts=1 (restart from the per-epoch checkpoint) and with --elastic (in place).

    python scripts/dev/bench_elastic.py --rounds 6 > docs/bench/elastic-2core.txt
    python scripts/dev/bench_elastic.py --rounds 3 --compare-restart > docs/bench/elastic-restart-2core.txt
    python scripts/dev/bench_elastic.py --overhead > docs/bench/elastic-overhead-2core.txt
"""
import argparse
import os
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
from _dist import run_ranks  # noqa: E402


def _store():
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def _notice_body(rank, ws, mode):
    import torch
    import torch.distributed as dist

    for _ in range(20):
        dist.all_reduce(torch.ones(8))
    if rank == 1:
        time.sleep(0.2)
        _store().set("t0", repr(time.time()))
        if mode == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)
        try:
            raise ValueError("boom")
        except ValueError:
            sys.exit(3)
    try:
        dist.all_reduce(torch.ones(1 << 16))
    except dist.DistBackendError:
        t1 = time.time()
    return t1 - float(_store().get("t0"))


def _ddp_body(rank, ws, kill_step, steps):
    import torch
    import torch.distributed as dist

    from torchdist_ext.elastic import ElasticDDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    trainer = ElasticDDP(model, torch.optim.SGD(model.parameters(), lr=0.01))
    x, y = torch.randn(32, 256), torch.randn(32, 256)
    times = []
    for step in range(steps):
        if rank == 3 and step == kill_step:
            _store().set("tkill", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        t = time.time()
        trainer.step(lambda m: torch.nn.functional.mse_loss(m(x), y))
        times.append(time.time() - t)
        if step == kill_step:
            after_kill = time.time() - float(_store().get("tkill"))
    del dist  # the group is the shrunk one now; run_ranks destroys it
    return after_kill, statistics.median(times[:kill_step]), trainer.recoveries[0]["seconds"]


def _example(make_cmd):
    """Wall seconds of one examples/train_ddp.py run; make_cmd(script) gives the command."""
    import subprocess

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "train_ddp.py")
    t = time.perf_counter()
    proc = subprocess.run(make_cmd(script), capture_output=True, text=True)
    elapsed = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-2000:] + proc.stderr[-2000:])
    return elapsed


def compare_restart(rounds, nproc=3, epochs=4, fail_step=23):
    """Time lost to a SIGKILL at `fail_step` (mid epoch 2): torchrun --max-restarts=1 restarting
    from the per-epoch checkpoint, against ElasticDDP in place; each against its own run without
    a failure, interleaved."""
    import tempfile

    common = ["--epochs", str(epochs)]

    def torchrun(fail):
        def cmd(script):
            tmp = tempfile.mkdtemp(prefix="tdx-bench-")
            extra = ["--fail-at-step", str(fail_step), "--fail-once-file", os.path.join(tmp, "failed")] if fail else []
            return [sys.executable, "-m", "torchdist_ext.run", "--standalone", f"--nproc-per-node={nproc}",
                    "--max-restarts=1", "--log-dir", os.path.join(tmp, "logs"), script, *common,
                    "--checkpoint", os.path.join(tmp, "ck.pt"), *extra]
        return cmd

    def elastic(fail):
        def cmd(script):
            extra = ["--fail-at-step", str(fail_step)] if fail else []
            return [sys.executable, script, "--elastic", "--nproc", str(nproc), *common, *extra]
        return cmd

    cols = {}
    for _ in range(rounds):
        for name, make in (("torchrun restart", torchrun), ("elastic in place", elastic)):
            for fail in (False, True):
                cols.setdefault((name, fail), []).append(_example(make(fail)))
    print(f"examples/train_ddp.py, {nproc} ranks, {epochs} epochs, SIGKILL of rank 1 before step {fail_step} "
          f"(mid epoch 2); wall seconds, median of {rounds}")
    print(f"{'how':<18} {'no failure':>11} {'failure':>9} {'time lost':>10}")
    for name in ("torchrun restart", "elastic in place"):
        ok, bad = statistics.median(cols[(name, False)]), statistics.median(cols[(name, True)])
        print(f"{name:<18} {ok:>11.2f} {bad:>9.2f} {bad - ok:>10.2f}")


def _overhead_body(rank, ws, steps):
    import torch
    import torch.nn.functional as F

    from torchdist_ext import DistributedDataParallel
    from torchdist_ext.elastic import ElasticDDP

    def net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))

    plain_net, elastic_net = net(), net()
    plain_opt = torch.optim.SGD(plain_net.parameters(), lr=0.1)
    plain, elastic = DistributedDataParallel(plain_net), ElasticDDP(elastic_net, torch.optim.SGD(
        elastic_net.parameters(), lr=0.1))
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))

    def plain_step():
        plain_opt.zero_grad(set_to_none=True)
        F.cross_entropy(plain(x), y).backward()
        plain_opt.step()

    return interleaved(plain_step, lambda: elastic.step(lambda m: F.cross_entropy(m(x), y)), steps)


def interleaved(step_a, step_b, steps):
    """Median seconds of ``step_a`` and of ``step_b``, run alternately ``steps`` times each (the
    first fifth of each dropped as warm-up)."""
    a, b = [], []
    for _ in range(steps):
        t = time.perf_counter()
        step_a()
        a.append(time.perf_counter() - t)
        t = time.perf_counter()
        step_b()
        b.append(time.perf_counter() - t)
    return statistics.median(a[steps // 5:]), statistics.median(b[steps // 5:])


def overhead(steps=300):
    """ElasticDDP.step against the same step with DistributedDataParallel alone (2 ranks)."""
    out = run_ranks(_overhead_body, 2, steps)
    print(f"no-failure step, 2 ranks, MLP 64-128-10, batch 32, median of {steps - steps // 5} interleaved steps (ms)")
    print(f"{'rank':>4} {'DDP':>8} {'ElasticDDP':>11} {'ratio':>6}")
    for r, (a, b) in enumerate(out):
        print(f"{r:>4} {1e3 * a:>8.3f} {1e3 * b:>11.3f} {b / a:>6.2f}")


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--compare-restart", action="store_true",
                    help="only the time lost against torchrun --max-restarts restarting from a checkpoint")
    ap.add_argument("--overhead", action="store_true", help="only ElasticDDP's cost per step without a failure")
    args = ap.parse_args()
    print(f"# {' '.join(sys.argv)}; load: {os.getloadavg()}")
    if args.overhead:
        overhead()
        print(f"# load after: {os.getloadavg()}")
        return
    if args.compare_restart:
        compare_restart(args.rounds)
        print(f"# load after: {os.getloadavg()}")
        return
    cols = {}
    for i in range(args.rounds):
        for mode in ("sys_exit", "sigterm"):
            for notice in ("1", "0"):
                out = run_ranks(_notice_body, 2, mode, pg_timeout=60, expect_failure_ranks=True, timeout=200,
                                env={"TDX_FAILURE_NOTICE": notice})
                status, dt = out[0]
                if status == "ok":
                    cols.setdefault((mode, notice), []).append(dt)
    print("failure notice: victim's failure -> peer raises (ms), 2 ranks")
    print(f"{'how':<10} {'notice':>7} {'n':>3} {'p50':>9} {'p90':>9}")
    for (mode, notice), xs in sorted(cols.items()):
        print(f"{mode:<10} {'on' if notice == '1' else 'off':>7} {len(xs):>3} {1e3 * statistics.median(xs):>9.1f} "
              f"{1e3 * _pct(xs, 0.9):>9.1f}")
    rows = []
    for i in range(max(1, args.rounds // 3)):
        out = run_ranks(_ddp_body, 4, 20, 30, pg_timeout=60, expect_failure_ranks=True, timeout=300)
        rows += [out[r][1] for r in (0, 1, 2) if out[r][0] == "ok"]
    print("ElasticDDP, 4 ranks, SIGKILL of rank 3 at step 20 (seconds)")
    print(f"{'kill -> next step done p50':>28} {'p90':>8} {'recovery p50':>13} {'step p50':>9}")
    print(f"{statistics.median(r[0] for r in rows):>28.3f} {_pct([r[0] for r in rows], 0.9):>8.3f} "
          f"{statistics.median(r[2] for r in rows):>13.3f} {statistics.median(r[1] for r in rows):>9.4f}")
    print(f"# load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
