"""Pipeline benchmark: our schedules against torch.distributed.pipelining's, side by side.

    python -m torchdist_ext.bench pipeline --world-size 2
    python -m torchdist_ext.bench pipeline --world-size 2 --microbatches 1,2,4,8,16 --backend tdx

For every micro-batch count m it times, in the same worker processes on the same model (an MLP
of equal Linear layers, one block of --depth layers per stage) and backend: our
ScheduleGPipe and Schedule1F1B, torch's ScheduleGPipe and Schedule1F1B (with torch's
PipelineStage; torch's 1F1B refuses m < stages, shown as n/a), and the whole model on one rank
(the no-pipeline anchor). The configurations take turns step by step (every configuration once
per round, in a new seeded order each round), so a change in machine load hits all of them alike. It reports:

- step time (max over ranks of the per-rank median after warm-up, a barrier before every step;
  with ``--repeats k``, the median of k such figures, each from freshly built models and schedules),
  the ratio torch / ours (above 1: ours is faster) and the speedup of our 1F1B over one rank;
- the measured bubble fraction of our schedules: per step, 1 - (compute time averaged over the
  ranks) / (the longest rank's step time), median over steps (compute = time inside forward, loss,
  backward and our batched weight-gradient products), next to the theoretical (p-1)/(m+p-1);
- the peak activation memory per rank: the most bytes of tensors saved for backward alive at once
  (distinct storages, parameters excluded, counted through saved-tensor hooks in a separate step),
  for ours plus the most bytes its stages kept for batched weight gradients (PipelineStage's
  batch_weight_grads; an upper bound, since the two peaks need not coincide);
- the CPU time per step (``time.process_time`` of the whole worker process, every thread included,
  e.g. the backend's progress thread; median over steps, mean over ranks): less sensitive to other
  load on the machine than step time, though it includes the polling of ranks that wait.
"""
import os
import queue
import statistics
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchdist_ext.bench._common import parser, print_command, seeded_order

__all__ = ["main"]

IMPLS = [("ours", "gpipe"), ("ours", "1f1b"), ("torch", "gpipe"), ("torch", "1f1b")]


class _SleepFn(torch.autograd.Function):
    """Forward sleeps ``ms`` per full batch (scaled by the micro-batch's share), backward twice that."""

    @staticmethod
    def forward(ctx, x, ms, batch):
        ctx.ms, ctx.batch = ms, batch
        time.sleep(ms * 1e-3 * x.shape[0] / batch)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(2 * ctx.ms * 1e-3 * g.shape[0] / ctx.batch)
        return g, None, None


class _Sleep(torch.nn.Module):
    def __init__(self, ms, batch):
        super().__init__()
        self.ms, self.batch = ms, batch

    def forward(self, x):
        return _SleepFn.apply(x, self.ms, self.batch)


def _model(width, depth, stages, sleep_ms=0.0, batch=1):
    """``stages`` blocks of depth x (Linear + ReLU), one block per stage; with sleep_ms every block
    ends with a sleep (a stage cost that does not compete for the CPU)."""
    torch.manual_seed(0)
    blocks = []
    for _ in range(stages):
        layers = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        if sleep_ms:
            layers.append(_Sleep(sleep_ms, batch))
        blocks.append(torch.nn.Sequential(*layers))
    return torch.nn.Sequential(*blocks)


class _SavedTensorPeak:
    """Peak bytes of distinct storages saved for backward (parameters excluded)."""

    def __init__(self, exclude):
        self.exclude = {p.untyped_storage().data_ptr() for p in exclude}
        self.live = {}
        self.current = self.peak = 0

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.exclude or ptr == 0:
            return t
        entry = self.live.get(ptr)
        if entry is None:
            nbytes = t.untyped_storage().nbytes()
            self.live[ptr] = [1, nbytes]
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        else:
            entry[0] += 1
        # a detached alias: holding the tensor itself would tie an op's saved output to its grad_fn in a
        # reference cycle that outlives a graph kept with retain_graph (as a split backward keeps it)
        return _Held(self, ptr, t.detach())

    @staticmethod
    def unpack(h):
        return h.t if isinstance(h, _Held) else h

    def release(self, ptr):
        entry = self.live[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[ptr]


# It only observes: our stages' batched weight gradients stay on under it (pipeline/_wgrad.py).
_SavedTensorPeak.pack.tdx_observe_only = True


class _Held:
    __slots__ = ("owner", "ptr", "t")

    def __init__(self, owner, ptr, t):
        self.owner, self.ptr, self.t = owner, ptr, t

    def __del__(self):
        self.owner.release(self.ptr)


class _ComputeMeter:
    """Times one rank's compute in our schedules from outside the runtime: it wraps the stage's
    forward_one, backward_one and flush_weight_grads (on the instance) and the loss function, and
    the schedule's step, summing the seconds spent inside them (``compute_s``) and the step's wall
    time (``step_s``). Waits for messages happen outside the wrapped calls, so they are not counted."""

    def __init__(self):
        self.compute_s = 0.0
        self.step_s = 0.0

    def timed(self, fn, field="compute_s"):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, field, getattr(self, field) + time.perf_counter() - t0)
        return wrapper

    def install(self, sched, stage):
        for name in ("forward_one", "backward_one", "flush_weight_grads"):
            setattr(stage, name, self.timed(getattr(stage, name)))
        sched._loss_fn = self.timed(sched._loss_fn)
        sched.step = self.timed(sched.step, "step_s")

    def take(self):
        """(compute_s, step_s) since the last take."""
        out = (self.compute_s, self.step_s)
        self.compute_s = self.step_s = 0.0
        return out


def _build(impl, kind, part, rank, ws, m, loss_fn):
    """(schedule, meter): our schedules carry a _ComputeMeter, torch's None."""
    if impl == "ours":
        from torchdist_ext.pipeline import PipelineStage, Schedule1F1B, ScheduleGPipe
    else:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    stage = PipelineStage(part, rank, ws, torch.device("cpu"))
    sched = (ScheduleGPipe if kind == "gpipe" else Schedule1F1B)(stage, m, loss_fn=loss_fn)
    meter = None
    if impl == "ours":
        meter = _ComputeMeter()
        meter.install(sched, stage)
    return sched, meter


def _one_step(sched, rank, ws, x, y):
    if rank == 0:
        sched.step(x)
    elif rank == ws - 1:
        sched.step(target=y)
    else:
        sched.step()


def _reduce_median(times, op):
    t = torch.tensor([statistics.median(times)])
    dist.all_reduce(t, op=op)
    return t.item()


def _build_runs(args, rank, ws, m, x, y, loss_fn):
    """{(impl, kind): (step, schedule, module, meter)} for m micro-batches, plus the whole-model anchor."""
    runs = {}
    full = _model(args.width, args.depth, ws, args.sleep_ms, args.batch)  # anchor: the whole model on rank 0
    opt_full = torch.optim.SGD(full.parameters(), lr=1e-4)

    def full_step():
        if rank == 0:  # (the others wait at the next barrier)
            opt_full.zero_grad()
            loss_fn(full(x), y).backward()
            opt_full.step()

    for impl, kind in IMPLS:
        if impl == "torch" and kind == "1f1b" and m < ws:
            continue  # torch's 1F1B refuses fewer micro-batches than stages
        part = _model(args.width, args.depth, ws, args.sleep_ms, args.batch)[rank]
        opt = torch.optim.SGD(part.parameters(), lr=1e-4)
        sched, meter = _build(impl, kind, part, rank, ws, m, loss_fn)

        def step(sched=sched, opt=opt):
            opt.zero_grad()
            _one_step(sched, rank, ws, x, y)
            opt.step()

        runs[(impl, kind)] = (step, sched, part, meter)
    runs[("single", "whole model")] = (full_step, None, full, None)
    return runs


def _measure(args, runs, seed, ws):
    """{config: (step s, bubble, cpu s)} of one repeat: configurations interleaved step by step."""
    times = {k: [] for k in runs}
    cpu = {k: [] for k in runs}
    bubbles = {k: [] for k in runs}
    # Every configuration runs once per round, so load drift hits all alike, in a new order each
    # round (shuffled with a seed made of m, the repeat and the round, so every rank agrees): no
    # configuration always follows the same one (the one before leaves its weights in the caches,
    # its blocks in the allocator).
    for i in range(args.warmup + args.steps):
        for key in seeded_order(runs, seed * 100_000 + i):  # the same on every rank
            step, _, _, meter = runs[key]
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            step()
            if i >= args.warmup:
                times[key].append(time.perf_counter() - t0)
                cpu[key].append(time.process_time() - c0)
            if meter is not None:
                compute_s, step_s = meter.take()
                if i >= args.warmup:
                    bubbles[key].append((compute_s, step_s))
    out = {}
    for key in runs:
        t = _reduce_median(times[key], dist.ReduceOp.MAX)
        cpu_s = _reduce_median(cpu[key], dist.ReduceOp.SUM) / ws
        bubble = None
        if key[0] == "ours":
            # per step: 1 - (mean compute over ranks) / (longest rank's step), then the median
            compute = torch.tensor([c for c, _ in bubbles[key]])
            span = torch.tensor([s for _, s in bubbles[key]])
            dist.all_reduce(compute)
            dist.all_reduce(span, op=dist.ReduceOp.MAX)
            bubble = statistics.median((1.0 - compute / ws / span).tolist())
        out[key] = (t, bubble, cpu_s)
    return out


def _peak_saved_bytes(impl, run):
    """The largest bytes of saved activations any rank holds during one step of `run`."""
    step, sched, part, _ = run
    tracker = _SavedTensorPeak(part.parameters())
    ours = list(sched._stages.values()) if impl == "ours" else []
    for s in ours:
        s.peak_pending_weight_grad_bytes = 0
    dist.barrier()
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
        step()
    # plus what our stages keep for their batched weight gradients (an upper bound: the
    # two peaks need not coincide)
    kept = sum(s.peak_pending_weight_grad_bytes for s in ours)
    peak = torch.tensor([float(tracker.peak + kept)])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return peak.item()


def _init_worker(rank, args, tmpdir):
    """Joins the benchmark's group (file:// rendezvous in tmpdir); returns the batch (x, y) every rank builds."""
    import torchdist_ext  # noqa: F401  (registers "tdx")

    torch.set_num_threads(args.threads)
    dist.init_process_group(args.backend, init_method=f"file://{tmpdir}/init", rank=rank,
                            world_size=args.world_size, timeout=timedelta(seconds=300))
    g = torch.Generator().manual_seed(1)
    return torch.randn(args.batch, args.width, generator=g), torch.randn(args.batch, args.width, generator=g)


def _worker(rank, args, tmpdir, results):
    ws = args.world_size
    x, y = _init_worker(rank, args, tmpdir)
    loss_fn = torch.nn.functional.mse_loss
    rows = []
    for m in args.microbatches:
        # Each repeat builds fresh models and schedules (new memory placement), so a placement that
        # happens to favour one configuration does not decide the result; figures are medians over repeats.
        reps = []
        for rep in range(args.repeats):
            runs = _build_runs(args, rank, ws, m, x, y, loss_fn)
            reps.append(_measure(args, runs, seed=m * 1000 + rep, ws=ws))
        for impl, kind in IMPLS + [("single", "whole model")]:
            key = (impl, kind)
            if key not in runs:
                rows.append((impl, kind, m, None, None, None, None))
                continue
            t, bubble, cpu_s = (statistics.median(r[key][i] for r in reps) if reps[0][key][i] is not None else None
                                for i in range(3))
            peak = _peak_saved_bytes(impl, runs[key]) if impl != "single" else None
            rows.append((impl, kind, m, t, bubble, peak, cpu_s))
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def _model_options(p, width, depth, depth_help, microbatches):
    """--backend, --width, --depth, --microbatches (the pipeline benchmarks' model and micro-batch counts)."""
    p.add_argument("--backend", default="tdx")
    p.add_argument("--width", type=int, default=width)
    p.add_argument("--depth", type=int, default=depth, help=depth_help)
    p.add_argument("--microbatches", default=microbatches, help="comma list of micro-batch counts")


def _parse_microbatches(p, args):
    args.microbatches = [int(v) for v in args.microbatches.split(",")]
    bad = [m for m in args.microbatches if args.batch % m]
    if bad:
        p.error(f"--batch {args.batch} is not divisible by micro-batch counts {bad}")


def main(argv=None):
    p = parser("pipeline", __doc__, steps=20, warmup=3, batch=128, batch_help="the whole batch",
               world_help="pipeline stages (one per rank)")
    _model_options(p, width=512, depth=4, depth_help="Linear+ReLU layers per stage", microbatches="1,2,4,8,16")
    p.add_argument("--repeats", type=int, default=1,
                   help="build fresh models and schedules this many times per m and report medians over repeats")
    p.add_argument("--sleep-ms", type=float, default=0.0,
                   help="add a sleep of this many ms per stage and batch to the forward (2x in backward): a stage "
                        "cost that does not compete for CPU, to measure schedules and bubbles on a busy machine")
    args = p.parse_args(argv)
    _parse_microbatches(p, args)
    ws = args.world_size
    print_command("pipeline", argv)
    params = sum(q.numel() for q in _model(args.width, args.depth, ws, args.sleep_ms, args.batch).parameters())
    print(f"# {ws} stages on {ws} ranks ({args.backend}); model {args.depth * ws}x Linear({args.width})+ReLU "
          f"({params / 1e6:.2f} M params){f' + sleep {args.sleep_ms:g} ms fwd / {2 * args.sleep_ms:g} ms bwd per stage and batch' if args.sleep_ms else ''}, "
          f"batch {args.batch}, mse loss, SGD; torch {torch.__version__}, "
          f"cores={os.cpu_count()}, threads/rank={args.threads}, median of {args.steps} steps"
          f"{f', median of {args.repeats} repeats' if args.repeats > 1 else ''}; loadavg {os.getloadavg()[0]:.2f}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_worker, args=(r, args, tmp, results)) for r in range(ws)]
        for pr in procs:
            pr.start()
        rows = None
        while rows is None:
            try:
                rows = results.get(timeout=1.0)
            except queue.Empty:
                dead = [(r, pr.exitcode) for r, pr in enumerate(procs) if pr.exitcode not in (None, 0)]
                if dead:
                    for pr in procs:
                        pr.kill()
                    raise SystemExit(f"benchmark worker(s) failed (rank, exit code): {dead}")
        for pr in procs:
            pr.join()
    by = {(impl, kind, m): (t, b, peak, c) for impl, kind, m, t, b, peak, c in rows}
    print(f"{'m':>3} {'theory':>6} | {'ours GPipe':>10} {'bubble':>6} | {'ours 1F1B':>9} {'bubble':>6} {'samples/s':>9} | "
          f"{'torch GPipe':>11} {'torch 1F1B':>10} | {'torch/ours GPipe':>16} {'torch/ours 1F1B':>15} | "
          f"{'1 rank':>8} {'1F1B speedup':>12}")
    for m in args.microbatches:
        og, o1, tg, t1 = (by[(i, k, m)] for i, k in IMPLS)
        single = by[("single", "whole model", m)][0]
        theory = (ws - 1) / (m + ws - 1)
        t1_ms = f"{t1[0] * 1e3:>7.2f} ms" if t1[0] is not None else f"{'n/a':>10}"
        t1_ratio = f"{t1[0] / o1[0]:>14.2f}x" if t1[0] is not None else f"{'n/a':>15}"
        print(f"{m:>3} {theory:>6.3f} | {og[0] * 1e3:>7.2f} ms {og[1]:>6.3f} | {o1[0] * 1e3:>6.2f} ms {o1[1]:>6.3f} "
              f"{args.batch / o1[0]:>9.0f} | {tg[0] * 1e3:>8.2f} ms {t1_ms} | {tg[0] / og[0]:>15.2f}x {t1_ratio} | "
              f"{single * 1e3:>5.1f} ms {single / o1[0]:>11.2f}x")
    print("# peak activation memory per rank (MiB of tensors saved for backward, ours plus those kept for batched "
          "weight gradients; max over ranks)")
    print(f"{'m':>3} | {'ours GPipe':>10} {'ours 1F1B':>9} {'1F1B/GPipe':>10} | {'torch GPipe':>11} {'torch 1F1B':>10}")
    for m in args.microbatches:
        og, o1, tg, t1 = (by[(i, k, m)][2] for i, k in IMPLS)
        t1_mib = f"{t1 / 2**20:>10.2f}" if t1 is not None else f"{'n/a':>10}"
        print(f"{m:>3} | {og / 2**20:>10.2f} {o1 / 2**20:>9.2f} {o1 / og:>10.2f} | {tg / 2**20:>11.2f} {t1_mib}")
    print("# CPU time per step (ms, process_time of each worker incl. the backend's threads, median over steps, "
          "mean over ranks)")
    print(f"{'m':>3} | {'ours GPipe':>10} {'ours 1F1B':>9} | {'torch GPipe':>11} {'torch 1F1B':>10} | "
          f"{'torch/ours GPipe':>16} {'torch/ours 1F1B':>15}")
    for m in args.microbatches:
        og, o1, tg, t1 = (by[(i, k, m)][3] for i, k in IMPLS)
        t1_ms = f"{t1 * 1e3:>10.2f}" if t1 is not None else f"{'n/a':>10}"
        t1_ratio = f"{t1 / o1:>14.2f}x" if t1 is not None else f"{'n/a':>15}"
        print(f"{m:>3} | {og * 1e3:>10.2f} {o1 * 1e3:>9.2f} | {tg * 1e3:>11.2f} {t1_ms} | {tg / og:>15.2f}x {t1_ratio}")


if __name__ == "__main__":
    main()
