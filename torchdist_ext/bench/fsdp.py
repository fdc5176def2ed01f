"""Memory and step-time benchmark of FullyShardedDataParallel (ZeRO 1/2/3) against our DDP and
torch's FSDP2 (``torch.distributed.fsdp.fully_shard``), same model, same backend, same run.

    python -m torchdist_ext.bench fsdp --world-size 2
    python -m torchdist_ext.bench fsdp --world-size 2 --backend gloo --width 1024 --depth 8

Each configuration runs in fresh worker processes (so process peak memory is its own), one after
the other in one invocation: ours stage 1, 2, 3, our DistributedDataParallel, torch's FSDP2 (one
fully_shard per block, then the root, its default reshard_after_forward=True, i.e. ZeRO-3).
Reported per configuration (max over ranks):
- state MiB: bytes of parameters + gradients + AdamW state this rank holds after a step
  (distinct storages; torch's DTensors counted by their local shards);
- alloc peak MiB: the most bytes malloc had handed out (glibc mallinfo2: in use, not cached; torch's
  CPU allocator is malloc), sampled every millisecond from building the model to the last step,
  minus the figure just before the model was built (so the interpreter and torch are not counted);
  it includes building the unsharded model on every rank before sharding, as both FSDPs need;
- RSS peak MiB: the same for process resident memory (includes what malloc keeps cached);
- step ms: median over the timed steps (barrier before each) of forward+backward+AdamW step.
With --rounds R every configuration runs R times, interleaved, and each figure is its lowest
round (the least disturbed on a shared machine). Ratios are against torch's FSDP2 (time, peak) and against the unsharded state / N (state).
"""
import ctypes
import os
import statistics
import tempfile
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from torchdist_ext.bench._common import parser, print_command

__all__ = ["main"]

CONFIGS = ["zero1", "zero2", "zero3", "ddp", "fsdp2"]


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = torch.nn.Linear(width, width)

    def forward(self, x):
        return torch.relu(self.fc(x))


def _model(width, depth):
    return torch.nn.Sequential(*[Block(width) for _ in range(depth)], torch.nn.Linear(width, 10))


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def _allocated_bytes():
    """Bytes glibc's malloc has handed out and not taken back (torch's CPU allocator uses it):
    what the process uses, without memory malloc keeps cached. -1 without glibc >= 2.33."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _Mallinfo2
    except (OSError, AttributeError):
        return -1
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


class _PeakSampler:
    """Samples resident memory and malloc's in-use bytes every millisecond; keeps the maxima."""

    def __init__(self):
        self.peak = _rss_bytes()
        self.peak_alloc = _allocated_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self):
        self.peak = max(self.peak, _rss_bytes())
        self.peak_alloc = max(self.peak_alloc, _allocated_bytes())

    def _run(self):
        while not self._stop.is_set():
            self._sample()
            time.sleep(0.001)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *a):
        self._stop.set()
        self._thread.join()
        self._sample()


def _local(t):
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # DTensor -> its shard


def _state_bytes(model, opt):
    from torchdist_ext.fsdp import training_state_bytes

    if hasattr(model, "units"):
        return training_state_bytes(model, opt)["total"]
    seen, total = set(), 0
    tensors = [_local(p) for p in model.parameters()] + [_local(p.grad) for p in model.parameters() if p.grad is not None]
    tensors += [_local(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def _build(config, args):
    import torchdist_ext

    torch.manual_seed(0)
    model = _model(args.width, args.depth)
    if config.startswith("zero"):
        return torchdist_ext.FullyShardedDataParallel(model, stage=int(config[-1]),
                                                      auto_wrap_policy=torchdist_ext.ModuleWrapPolicy({Block}))
    if config == "ddp":
        return torchdist_ext.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model[:-1]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _worker(rank, config, args, tmpdir, results):
    torch.set_num_threads(args.threads)
    import torchdist_ext  # noqa: F401  (registers "tdx")

    dist.init_process_group(args.backend, init_method=f"file://{tmpdir}/init-{config}", rank=rank,
                            world_size=args.world_size, timeout=timedelta(seconds=300))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)
    base, base_alloc = _rss_bytes(), _allocated_bytes()
    with _PeakSampler() as sampler:
        model = _build(config, args)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        times = []
        for i in range(args.warmup + args.steps):
            dist.barrier()
            t0 = time.perf_counter()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)  # keep gradients: the state figure includes them
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
    state = _state_bytes(model, opt)
    row = torch.tensor([statistics.median(times), float(state), float(sampler.peak - base),
                        float(sampler.peak_alloc - base_alloc)], dtype=torch.float64)
    dist.all_reduce(row, op=dist.ReduceOp.MAX)
    if rank == 0:
        results.put((config, row.tolist()))
    dist.destroy_process_group()


def main(argv=None):
    p = parser("fsdp", __doc__, steps=20, warmup=3, batch=16)
    p.add_argument("--backend", default="tdx")
    p.add_argument("--width", type=int, default=1024, help="Linear width (params per block: width^2 + width)")
    p.add_argument("--depth", type=int, default=8, help="number of blocks (each its own unit)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list out of {CONFIGS}")
    p.add_argument("--rounds", type=int, default=2,
                   help="run every configuration this many times, interleaved; each figure is the best round's")
    args = p.parse_args(argv)
    configs = args.configs.split(",")
    params = sum(t.numel() for t in _model(args.width, args.depth).parameters())
    print_command("fsdp", argv)
    print(f"# world_size={args.world_size} backend={args.backend} model={args.depth}x Linear({args.width}) + head "
          f"({params / 1e6:.2f} M params) AdamW batch={args.batch}/rank torch {torch.__version__} cores={os.cpu_count()}")
    ctx = mp.get_context("spawn")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for config in configs:
                results = ctx.SimpleQueue()
                procs = [ctx.Process(target=_worker, args=(r, config, args, f"{tmp}/{rnd}", results))
                         for r in range(args.world_size)]
                os.makedirs(f"{tmp}/{rnd}", exist_ok=True)
                for pr in procs:
                    pr.start()
                for pr in procs:
                    pr.join()
                if any(pr.exitcode != 0 for pr in procs):
                    print(f"{config}: failed (exit codes {[pr.exitcode for pr in procs]})")
                    continue
                name, row = results.get()
                best = rows.get(name)
                rows[name] = row if best is None else [min(a, b) for a, b in zip(best, row)]
    unsharded = params * 16  # fp32 params + grads + two AdamW states
    ideal = unsharded / args.world_size
    anchor = rows.get("fsdp2")
    print(f"{'config':>7} {'step ms':>9} {'state MiB':>10} {'alloc peak MiB':>15} {'RSS peak MiB':>13}"
          f" {'state/(unsharded/N)':>20} {'time vs fsdp2':>14} {'alloc peak vs fsdp2':>20} {'RSS peak vs fsdp2':>18}")
    for config in configs:
        if config not in rows:
            continue
        t, state, peak, alloc = rows[config]
        rel = (f"{t / anchor[0]:>13.2f}x {alloc / max(anchor[3], 1):>19.2f}x {peak / max(anchor[2], 1):>17.2f}x"
               if anchor else "")
        print(f"{config:>7} {t * 1e3:>9.2f} {state / 2**20:>10.2f} {alloc / 2**20:>15.1f} {peak / 2**20:>13.1f}"
              f" {state / ideal:>20.3f} {rel}")
    print(f"# unsharded state {unsharded / 2**20:.1f} MiB, / N = {ideal / 2**20:.1f} MiB; ratios > 1 are more time or"
          " memory than torch's FSDP2")


if __name__ == "__main__":
    main()
