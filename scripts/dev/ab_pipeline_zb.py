"""A/B of the pipeline runtime in one run: an earlier version of ``torchdist_ext/pipeline`` ("before"),
this tree's ("after") and torch's same schedule, on the pipeline-zb benchmark's model.

    git archive HEAD torchdist_ext/pipeline | tar -x -C /tmp/before     # the version to compare against
    python scripts/dev/ab_pipeline_zb.py --before /tmp/before/torchdist_ext/pipeline --backend gloo \\
        --schedules zbv,dualpipev,1f1b,zbh1 --microbatches 4,8 --steps 30

The "before" folder is loaded as the package ``torchdist_ext._pipeline_before`` (its relative imports
resolve inside this tree's torchdist_ext, so only the pipeline package differs). Every configuration
runs once per round in a seeded new order, a barrier before each step, so a loaded machine's drift
hits all alike. Per configuration: the median over steps of the slowest rank's step time, the
median CPU time per step summed over ranks (``time.process_time``: every thread of the rank's
process, gloo's included), and torch / before and torch / after (above 1: faster than torch).
"""
import argparse
import importlib.util
import os
import pathlib
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

KINDS = ["1f1b", "zbh1", "zbv", "dualpipev"]


def _load_before(path):
    import torchdist_ext

    name = "torchdist_ext._pipeline_before"
    spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    torchdist_ext._pipeline_before = mod
    return mod


def _build(impl, kind, rank, ws, m, args, before):
    from torchdist_ext.bench.pipeline_zb import _build as build

    import torchdist_ext.pipeline as after
    package = {"before": before, "after": after}.get(impl)
    args.sleep_ms = 0.0
    return build("torch" if impl == "torch" else "ours", kind, rank, ws, m, args, torch.nn.functional.mse_loss,
                 package)[0]


def _worker(rank, args, tmpdir, q):
    import torchdist_ext  # noqa: F401
    from torchdist_ext.bench._common import seeded_order

    torch.set_num_threads(1)
    ws = args.world_size
    dist.init_process_group(args.backend, init_method=f"file://{tmpdir}/init", rank=rank, world_size=ws)
    before = _load_before(args.before)
    g = torch.Generator().manual_seed(1)
    args.x, args.y = torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, args.width, generator=g)
    rows = []
    for m in args.microbatches:
        runs = {(impl, kind): _build(impl, kind, rank, ws, m, args, before)
                for kind in args.schedules for impl in ("torch", "before", "after")}
        wall = {k: [] for k in runs}
        cpu = {k: [] for k in runs}
        for i in range(args.warmup + args.steps):
            for key in seeded_order(sorted(runs), m * 100_000 + i):
                dist.barrier()
                c0, t0 = time.process_time(), time.perf_counter()
                runs[key]()
                t, c = time.perf_counter() - t0, time.process_time() - c0
                if i >= args.warmup:
                    wall[key].append(t)
                    cpu[key].append(c)
        for key in sorted(runs):
            w, c = torch.tensor(wall[key]), torch.tensor(cpu[key])
            dist.all_reduce(w, op=dist.ReduceOp.MAX)
            dist.all_reduce(c)
            rows.append((key[1], m, key[0], statistics.median(w.tolist()), statistics.median(c.tolist())))
    if rank == 0:
        q.put(rows)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", required=True, help="folder of the earlier torchdist_ext/pipeline package")
    p.add_argument("--backend", default="gloo")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--schedules", default="zbv,dualpipev,1f1b,zbh1")
    p.add_argument("--microbatches", default="4,8")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args()
    args.schedules = args.schedules.split(",")
    bad = [k for k in args.schedules if k not in KINDS]
    if bad:
        p.error(f"unknown schedules {bad}; choose from {KINDS}")
    args.microbatches = [int(x) for x in args.microbatches.split(",")]
    args.before = str(pathlib.Path(args.before).resolve())
    import torch.multiprocessing as mp

    print(f"# {' '.join(sys.argv)}")
    print(f"# loadavg before: {os.getloadavg()}; torch {torch.__version__}, cores={os.cpu_count()}")
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, args, tmp, q)) for r in range(args.world_size)]
        for pr in procs:
            pr.start()
        rows = q.get()
        for pr in procs:
            pr.join()
    by = {(k, m, impl): (w, c) for k, m, impl, w, c in rows}
    print(f"# loadavg after: {os.getloadavg()}")
    print(f"{'schedule':>9} {'m':>3} | {'torch ms':>8} {'before':>8} {'after':>8} | {'t/before':>8} {'t/after':>8} | "
          f"{'cpu ms torch':>12} {'before':>7} {'after':>7}")
    for k in args.schedules:
        for m in args.microbatches:
            (tw, tc), (bw, bc), (aw, ac) = by[(k, m, "torch")], by[(k, m, "before")], by[(k, m, "after")]
            print(f"{k:>9} {m:>3} | {tw * 1e3:>8.2f} {bw * 1e3:>8.2f} {aw * 1e3:>8.2f} | {tw / bw:>7.2f}x "
                  f"{tw / aw:>7.2f}x | {tc * 1e3:>12.2f} {bc * 1e3:>7.2f} {ac * 1e3:>7.2f}")


if __name__ == "__main__":
    main()
