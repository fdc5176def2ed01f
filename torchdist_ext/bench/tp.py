"""Our tensor parallelism against torch's DTensor tensor parallelism, same transformer, same backend.

    torchrun --standalone --nproc-per-node=2 -m torchdist_ext.bench tp [--steps 20 --hidden 256]

Both sides parallelize the same full model (Q, K, V, fc1 column-split; O, fc2 row-split) and run
forward + backward on the same batch, alternating per repeat. Rank 0 prints the median step time
of each and their ratio, parameter bytes per rank, and the collective payload bytes per step
(counted by our C++ communication operators) against Megatron's formula: without sequence
parallelism each layer all-reduces ``b*s*h`` elements twice in forward and twice in backward.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from ..tensor_parallel.models import Block, block_plan

__all__ = ["main", "run"]


def _model(layers, h, heads):
    torch.manual_seed(0)
    return nn.Sequential(*(Block(h, heads) for _ in range(layers)))


def _plan(layers, col="colwise", row="rowwise"):
    plan = {}
    for i in range(layers):
        plan.update(block_plan(f"{i}.", col, row))
    return plan


def _step(model, x):
    model.zero_grad(set_to_none=True)
    model(x).float().pow(2).mean().backward()


def _param_bytes(model):
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in model.parameters())


def run(steps=20, layers=2, hidden=256, heads=8, batch=4, seq=64):
    """Runs the comparison on the default group; returns a dict (same on every rank)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize
    from torchdist_ext.tensor_parallel import bytes_communicated, parallelize_module
    tp = dist.get_world_size()
    ours = parallelize_module(_model(layers, hidden, heads), None, _plan(layers))
    theirs = torch_parallelize(_model(layers, hidden, heads), init_device_mesh("cpu", (tp,)),
                               _plan(layers, ColwiseParallel, RowwiseParallel))
    torch.manual_seed(1)
    x = torch.randn(batch, seq, hidden)
    bytes_communicated(reset=True)
    _step(ours, x)
    comm = bytes_communicated(reset=True)
    times = {"ours": [], "dtensor": []}
    for m in (ours, theirs):  # warm-up
        _step(m, x)
    for _ in range(steps):
        for name, m in (("ours", ours), ("dtensor", theirs)):
            dist.barrier()
            t0 = time.perf_counter()
            _step(m, x)
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    formula = 4 * layers * batch * seq * hidden * 4 if tp > 1 else 0
    return {"tp": tp, "step_s": med, "ratio_dtensor_over_ours": med["dtensor"] / med["ours"],
            "param_bytes_per_rank": {"ours": _param_bytes(ours), "dtensor": _param_bytes(theirs),
                                     "unsplit": _param_bytes(_model(layers, hidden, heads))},
            "comm_bytes_per_step_ours": comm, "comm_bytes_megatron_formula": formula}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for n, d in (("steps", 20), ("layers", 2), ("hidden", 256), ("heads", 8), ("batch", 4), ("seq", 64)):
        p.add_argument(f"--{n}", type=int, default=d)
    p.add_argument("--backend", default="tdx")
    a = p.parse_args(argv)
    import torchdist_ext  # noqa: F401  (registers "tdx")
    dist.init_process_group(a.backend)
    torch.set_num_threads(1)
    r = run(a.steps, a.layers, a.hidden, a.heads, a.batch, a.seq)
    if dist.get_rank() == 0:
        pb = r["param_bytes_per_rank"]
        print(f"bench tp: tp={r['tp']} backend={a.backend} layers={a.layers} hidden={a.hidden} batch={a.batch} seq={a.seq}")
        print(f"step time  ours {r['step_s']['ours'] * 1e3:.2f} ms  dtensor {r['step_s']['dtensor'] * 1e3:.2f} ms  "
              f"dtensor/ours {r['ratio_dtensor_over_ours']:.2f}x")
        print(f"param bytes per rank  ours {pb['ours']}  dtensor {pb['dtensor']}  unsplit {pb['unsplit']}  "
              f"ours/unsplit {pb['ours'] / pb['unsplit']:.3f}")
        print(f"comm bytes per step  ours {r['comm_bytes_per_step_ours']}  megatron formula "
              f"{r['comm_bytes_megatron_formula']}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
