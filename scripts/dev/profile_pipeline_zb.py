"""cProfile of one rank of the pipeline-zb benchmark's model: ours against torch's same schedule.

    python scripts/dev/profile_pipeline_zb.py --schedule zbv --microbatches 4 --backend gloo

Builds each implementation as ``python -m torchdist_ext.bench pipeline-zb`` does (2 ranks), runs 3
warm-up steps and 20 profiled ones, and prints rank 0's p2p calls per step (the c10d ``send``,
``recv`` and ``wait`` bindings, counted by the profiler) and its top functions by own time. The
counts do not depend on the machine's load; the times do (compare them only within one run).
"""
import argparse
import cProfile
import io
import pathlib
import pstats
import sys
import time
import types

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent.parent / "tests"))

STEPS = 20


def _rank(rank, ws, impl, kind, m, top):
    import torch

    from torchdist_ext.bench import pipeline_zb

    args = types.SimpleNamespace(width=256, depth=2, sleep_ms=0.0, batch=64, x=torch.randn(64, 256),
                                 y=torch.randn(64, 256))
    step = pipeline_zb._build(impl, kind, rank, ws, m, args, torch.nn.functional.mse_loss)[0]
    for _ in range(3):
        step()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(STEPS):
        step()
    prof.disable()
    elapsed = (time.perf_counter() - t0) / STEPS
    stats = pstats.Stats(prof)
    calls = {fn[2].strip("<>").split()[-1]: v[1] / STEPS for fn, v in stats.stats.items()
             if "_distributed_c10d" in fn[2] and fn[2].split(".")[-1].rstrip(">}") in ("send", "recv", "wait")}
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return {"step_ms": elapsed * 1e3, "calls": calls, "profile": out.getvalue()}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--schedule", default="zbv", choices=["1f1b", "zbh1", "zbv", "dualpipev"])
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--top", type=int, default=12)
    a = p.parse_args()
    from _dist import run_ranks

    for impl in ("ours", "torch"):
        res = run_ranks(_rank, 2, impl, a.schedule, a.microbatches, a.top, backend=a.backend, timeout=900)[0]
        print(f"=== {impl} {a.schedule} m={a.microbatches} on {a.backend}, rank 0: {res['step_ms']:.2f} ms per "
              f"profiled step; p2p calls per step {res['calls']}")
        print(res["profile"])


if __name__ == "__main__":
    main()
