"""Zero-bubble pipeline benchmark: our schedules against torch.distributed.pipelining's, side by side.

    python -m torchdist_ext.bench pipeline-zb --world-size 2 --backend tdx
    python -m torchdist_ext.bench pipeline-zb --world-size 4 --backend gloo --plot docs/pipeline-zb-4rank.png

On one model (an MLP of 2 x world-size blocks of --depth Linear+ReLU layers) and one backend, in the
same worker processes, it times for every micro-batch count m, ours and torch's:

- 1F1B (one stage of two blocks per rank),
- ZB-H1 (``ScheduleInterleavedZeroBubble`` with one stage of two blocks per rank),
- ZB-V (``ScheduleZBVZeroBubble``) and DualPipeV (``ScheduleDualPipeV``): two one-block stages
  per rank in a V.

Configurations take turns step by step (each once per round, in a seeded new order per round, a
barrier before every step), so load drift hits all alike. Reported per configuration:

- step time: median over the timed steps of the slowest rank's step, and torch / ours (above 1:
  ours is faster);
- bubble: per step 1 - (compute time summed over ranks) / (ranks x the slowest rank's step),
  median over steps; compute = time inside the stage's forward, backward, input- and
  weight-gradient calls and the loss (for torch's, its stage's ``forward_one_chunk``,
  ``backward_one_chunk`` and ``backward_weight_one_chunk``); next to the simulator's bubble of
  our schedule at unit costs (F 1, I 1, W 1, B 2) and at the costs this run measured;
- ``--sleep-ms``: every block also sleeps in its forward, input gradient and weight gradient
  (equal costs, as the papers draw them, that a busy machine does not stretch);
- peak activation memory: the most bytes of tensors saved for backward alive at once on any rank
  (distinct storages, parameters excluded, counted through saved-tensor hooks in a separate step).

``--plot FILE.png`` draws one step of each of our zero-bubble schedules and of torch's, one row
per rank, at the largest m (F blue, B purple, I green, W orange), from timestamps taken around the
compute calls.
"""
import os
import statistics
import textwrap
import time

import torch
import torch.distributed as dist

from torchdist_ext.bench._common import parser, print_command, seeded_order, spawn_ranks
from torchdist_ext.bench.pipeline import _init_worker, _model_options, _parse_microbatches, _SavedTensorPeak

__all__ = ["main"]

KINDS = ["1f1b", "zbh1", "zbv", "dualpipev"]
NAMES = {"1f1b": "1F1B", "zbh1": "ZB-H1", "zbv": "ZB-V", "dualpipev": "DualPipeV"}
# what each stage method computes, for the timeline (torch's backward_one_chunk: B or I by its flag)
_KIND_OF = {"forward_one": "F", "backward_one": "B", "backward_input": "I", "backward_weight": "W",
            "forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}


class _SleepIn(torch.autograd.Function):
    """Sleeps ``ms`` (scaled by the micro-batch's share of the batch) in forward and in the input gradient."""

    @staticmethod
    def forward(ctx, x, ms, batch):
        ctx.s = ms * 1e-3 * x.shape[0] / batch
        time.sleep(ctx.s)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.s)
        return g, None, None


class _SleepW(torch.autograd.Function):
    """The weight's branch: sleeps as long in its gradient (which a split backward runs in W)."""

    @staticmethod
    def forward(ctx, w, s):
        ctx.s = s
        return w.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.s)
        return g, None


class _Sleep(torch.nn.Module):
    """F, I and W of equal cost that need no CPU (the papers' unit costs, on a busy machine)."""

    def __init__(self, width, ms, batch):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(width))
        self.ms, self.batch = ms, batch

    def forward(self, x):
        if not x.requires_grad:  # a first stage's input: give its input gradient its cost too
            x = x.detach().requires_grad_(True)
        return _SleepIn.apply(x, self.ms, self.batch) * _SleepW.apply(self.w, self.ms * 1e-3 * x.shape[0] / self.batch)


def _blocks(width, depth, n, sleep_ms=0.0, batch=1):
    torch.manual_seed(0)
    out = []
    for _ in range(n):
        layers = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        if sleep_ms:
            layers.append(_Sleep(width, sleep_ms, batch))
        out.append(torch.nn.Sequential(*layers))
    return out


class _Meter:
    """Sums the seconds spent inside a stage's compute calls and the loss; keeps their spans."""

    def __init__(self):
        self.compute = 0.0
        self.spans = []

    def wrap(self, obj, name, letter=None):
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                self.compute += t1 - t0
                kind = letter or _KIND_OF.get(name, "L")
                if name == "backward_one_chunk" and kwargs.get("full_backward", True) is False:
                    kind = "I"
                self.spans.append((kind, t0, t1))
        setattr(obj, name, timed)

    def take(self):
        out = (self.compute, self.spans)
        self.compute, self.spans = 0.0, []
        return out


def _build(impl, kind, rank, ws, m, args, loss_fn, package=None):
    """(step function, schedule, parameters, meter, stages). ``package``: the pipeline package "ours"
    is built from (torchdist_ext.pipeline when None; scripts/dev/ab_pipeline_zb.py passes an earlier one)."""
    if impl == "ours":
        from torchdist_ext import pipeline as P
        P = package or P
        PipelineStage = P.PipelineStage
    else:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining import schedules as P
    blocks = _blocks(args.width, args.depth, 2 * ws, args.sleep_ms, args.batch)
    if kind in ("zbv", "dualpipev"):
        idx = [rank, 2 * ws - 1 - rank]
        stages = [PipelineStage(blocks[s], s, 2 * ws, torch.device("cpu")) for s in idx]
        cls = P.ScheduleZBVZeroBubble if kind == "zbv" else P.ScheduleDualPipeV
        sched = cls(stages, m, loss_fn=loss_fn)
        first = last = rank == 0
    else:
        part = torch.nn.Sequential(blocks[2 * rank], blocks[2 * rank + 1])
        stages = [PipelineStage(part, rank, ws, torch.device("cpu"))]
        if kind == "1f1b":
            sched = P.Schedule1F1B(stages[0], m, loss_fn=loss_fn)
        else:
            sched = P.ScheduleInterleavedZeroBubble(stages, m, loss_fn=loss_fn)
        first, last = rank == 0, rank == ws - 1
    params = [p for s in stages for p in s.submod.parameters()]
    opt = torch.optim.SGD(params, lr=1e-4)
    meter = _Meter()
    for s in stages:
        for name in _KIND_OF:
            if callable(getattr(s, name, None)):
                meter.wrap(s, name)
    meter.wrap(sched, "_loss_fn", "L")
    x, y = args.x, args.y

    def step():
        opt.zero_grad()
        kw = {"target": y} if last else {}
        if first:
            sched.step(x, **kw)
        else:
            sched.step(**kw)
        opt.step()
    return step, sched, params, meter


def _measure(args, runs, seed, ws):
    times = {k: [] for k in runs}
    bubbles = {k: [] for k in runs}
    computes = {k: [] for k in runs}
    spans = {}
    for i in range(args.warmup + args.steps):
        for key in seeded_order(runs, seed * 100_000 + i):
            step, _, _, meter = runs[key]
            dist.barrier()
            t0 = time.perf_counter()
            step()
            t = time.perf_counter() - t0
            compute, sp = meter.take()
            if i < args.warmup:
                continue
            times[key].append(t)
            computes[key].append(compute)
            if i == args.warmup + args.steps - 1:
                spans[key] = [(k, a - t0, b - t0) for k, a, b in sp]
    out = {}
    for key in runs:
        t = torch.tensor(times[key])
        c = torch.tensor(computes[key])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        dist.all_reduce(c)
        bubble = statistics.median((1.0 - c / ws / t).tolist())
        out[key] = (statistics.median(t.tolist()), bubble)
    return out, spans


def _peak(run):
    step, _, params, _ = run
    tracker = _SavedTensorPeak(params)
    dist.barrier()
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
        step()
    run[3].take()
    peak = torch.tensor([float(tracker.peak)])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item()


def _simulated(sched, spans_by_rank):
    """Our schedule's bubble at unit costs, and at the mean measured cost of each (rank, stage, kind)."""
    unit = sched.simulate().bubble_fraction
    if spans_by_rank is None:
        return unit, None
    means = {}
    for r, spans in enumerate(spans_by_rank):
        for k in "FBIW":
            d = [b - a for kk, a, b in spans if kk == k]
            if d:
                means[(r, k)] = statistics.mean(d)
    res = sched.simulate(cost=lambda r, a: means.get((r, a.type.value), 0.0))
    return unit, res.bubble_fraction


def _worker(rank, args, tmpdir, results):
    ws = args.world_size
    args.x, args.y = _init_worker(rank, args, tmpdir)
    loss_fn = torch.nn.functional.mse_loss
    rows, charts = [], {}
    for m in args.microbatches:
        runs, failed = {}, {}
        for kind in KINDS:
            for impl in ("ours", "torch"):
                try:
                    runs[(impl, kind)] = _build(impl, kind, rank, ws, m, args, loss_fn)
                except Exception as err:  # noqa: BLE001 - e.g. torch refusing a micro-batch count
                    failed[(impl, kind)] = f"{type(err).__name__}: {str(err)[:60]}"
        flags = [None] * ws
        dist.all_gather_object(flags, sorted(failed))
        for bad in {tuple(k) for f in flags for k in f}:  # a configuration that failed on any rank runs nowhere
            runs.pop(bad, None)
            failed.setdefault(bad, "refused on another rank")
        measured, spans = _measure(args, runs, seed=m, ws=ws)
        every = [None] * ws
        dist.all_gather_object(every, spans)
        for key in sorted(runs):
            t, bubble = measured[key]
            peak = _peak(runs[key])
            sim = (None, None)
            if key[0] == "ours":
                sim = _simulated(runs[key][1], [e.get(key) for e in every] if all(key in e for e in every) else None)
            rows.append((key[0], key[1], m, t, bubble, peak, sim))
            if m == max(args.microbatches):
                charts[key] = [e.get(key, []) for e in every]
        for key, why in failed.items():
            rows.append((key[0], key[1], m, None, None, None, (None, why)))
    if rank == 0:
        results.put((rows, charts))
    dist.destroy_process_group()


def _plot(charts, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"F": "#4c72b0", "B": "#8172b2", "I": "#55a868", "W": "#dd8452", "L": "#999999"}
    keys = [(impl, k) for k in KINDS if k != "1f1b" for impl in ("ours", "torch") if (impl, k) in charts]
    if not keys:
        return
    fig, axes = plt.subplots(len(keys), 1, figsize=(11, 1.0 + 0.45 * len(keys) * len(charts[keys[0]])),
                             squeeze=False)
    end = max(b for key in keys for spans in charts[key] for _, _, b in spans)
    for ax, key in zip(axes[:, 0], keys):
        for r, spans in enumerate(charts[key]):
            for k, a, b in spans:
                ax.barh(r, (b - a) * 1e3, left=a * 1e3, color=colors.get(k, "#999999"), edgecolor="white",
                        linewidth=0.3)
        ax.set_yticks(range(len(charts[key])))
        ax.set_yticklabels([f"rank {r}" for r in range(len(charts[key]))])
        ax.invert_yaxis()
        ax.set_xlim(0, end * 1e3)
        ax.set_title(f"{key[0]} {NAMES[key[1]]}", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("ms since the step began")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, ["F", "B", "I", "W", "loss"], loc="lower right", ncol=5, fontsize=8)
    fig.suptitle(title, fontsize=8, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0.03, 1, 0.96))
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = parser("pipeline-zb", __doc__, steps=10, warmup=2, batch=64, batch_help="the whole batch",
               world_help="ranks (1F1B and ZB-H1: one stage each; ZB-V and DualPipeV: two each)")
    _model_options(p, width=256, depth=2, depth_help="Linear+ReLU layers per block (2 blocks per rank)",
                   microbatches="4,8")
    p.add_argument("--plot", default=None, help="PNG file for one step's timeline per rank at the largest m")
    p.add_argument("--sleep-ms", type=float, default=0.0,
                   help="end every block with a sleep of this many ms per batch in its forward, its input gradient "
                        "and its weight gradient each: equal F, I and W costs that need no CPU (schedules and bubbles "
                        "on a busy machine)")
    args = p.parse_args(argv)
    _parse_microbatches(p, args)
    ws = args.world_size
    print_command("pipeline-zb", argv)
    sleep = f" + sleep {args.sleep_ms:g} ms per batch in F, I and W" if args.sleep_ms else ""
    head = (f"{ws} ranks ({args.backend}); model {2 * ws} blocks x {args.depth} x Linear({args.width})+ReLU{sleep}, "
            f"batch "
            f"{args.batch}, mse loss, SGD; torch {torch.__version__}, cores={os.cpu_count()}, threads/rank="
            f"{args.threads}, median of {args.steps} steps; loadavg {os.getloadavg()[0]:.2f}")
    print(f"# {head}")
    rows, charts = spawn_ranks(_worker, ws, args)
    by = {(impl, kind, m): rest for impl, kind, m, *rest in rows}
    print(f"{'m':>3} {'schedule':>9} | {'ours ms':>8} {'torch ms':>8} {'torch/ours':>10} | {'bubble ours':>11} "
          f"{'sim unit':>8} {'sim meas':>8} {'torch':>6} | {'peak MiB ours':>13} {'torch':>6} {'ours/torch':>10}")
    for m in args.microbatches:
        for kind in KINDS:
            o, t = by.get(("ours", kind, m)), by.get(("torch", kind, m))
            if o is None or o[0] is None:
                print(f"{m:>3} {NAMES[kind]:>9} | ours did not run: {o[3][1] if o else '?'}")
                continue
            t_ms = f"{t[0] * 1e3:>8.2f}" if t and t[0] is not None else f"{'n/a':>8}"
            ratio = f"{t[0] / o[0]:>9.2f}x" if t and t[0] is not None else f"{'n/a':>10}"
            tb = f"{t[1]:>6.3f}" if t and t[1] is not None else f"{'n/a':>6}"
            tm = f"{t[2] / 2**20:>6.2f}" if t and t[2] is not None else f"{'n/a':>6}"
            mr = f"{o[2] / t[2]:>9.2f}x" if t and t[2] else f"{'n/a':>10}"
            sim_m = f"{o[3][1]:>8.3f}" if o[3][1] is not None else f"{'n/a':>8}"
            print(f"{m:>3} {NAMES[kind]:>9} | {o[0] * 1e3:>8.2f} {t_ms} {ratio} | {o[1]:>11.3f} {o[3][0]:>8.3f} "
                  f"{sim_m} {tb} | {o[2] / 2**20:>13.2f} {tm} {mr}")
            if t and t[0] is None:
                print(f"    torch's {NAMES[kind]} did not run: {t[3][1]}")
    if args.plot:
        _plot(charts, args.plot, textwrap.fill(f"one step at m={max(args.microbatches)}: {head}", 160))
        print(f"# timeline: {args.plot}")


if __name__ == "__main__":
    main()
