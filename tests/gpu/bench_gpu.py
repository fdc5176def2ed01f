"""GPU benchmarks of tdx (run by tests/gpu/run.sh; not a test). Every figure is a ratio against an
anchor measured in the same run:

1. kernels (bf16/fp16 compress, int8 quantize with error feedback) in GB/s of bytes
   read + written, against a device-to-device copy (torch's copy_, read + write) of the same size;
2. all_reduce at world size 1, tdx (its NCCL path) against torch's nccl backend, 4 KB to 256 MB;
3. DDP step time: torch's DDP and torchdist_ext.DistributedDataParallel on tdx, against torch's
   DDP on nccl, world size 1.

    python tests/gpu/bench_gpu.py --out results.json
"""
import argparse
import json
import os
import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import torchdist_ext
from torchdist_ext import kernels


def timed(fn, iters, warmup=5):
    """Median seconds of fn() over iters runs, each bracketed by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def bench_kernels(total_bytes, iters):
    n = total_bytes // 4
    x = torch.randn(n, device="cuda")
    y = torch.empty_like(x)
    copy_s = timed(lambda: y.copy_(x), iters)
    copy_bw = 2 * x.nbytes / copy_s
    rows = [{"kernel": "d2d copy (anchor)", "bytes": 2 * x.nbytes, "s": copy_s, "GB/s": copy_bw / 1e9, "of_copy": 1.0}]

    cases = [
        ("bf16 compress", lambda: kernels.compress_bf16(x), x.nbytes + x.nbytes // 2),
        ("fp16 compress", lambda: kernels.compress_fp16(x), x.nbytes + x.nbytes // 2),
    ]
    h = kernels.compress_bf16(x)
    cases.append(("bf16 decompress", lambda: kernels.decompress(h), h.nbytes + x.nbytes))
    r = torch.zeros_like(x)
    # reads x and r twice (absmax pass, quantize pass), writes q, r, scales
    cases.append(("int8 quantize + error feedback", lambda: kernels.int8_quantize(x, r),
                  4 * x.nbytes + x.numel() + x.nbytes + x.numel() // 256 * 4))
    q, s = kernels.int8_quantize(x)
    cases.append(("int8 dequantize", lambda: kernels.int8_dequantize(q, s, out=y), q.numel() + y.nbytes))
    for name, fn, nbytes in cases:
        sec = timed(fn, iters)
        bw = nbytes / sec
        rows.append({"kernel": name, "bytes": nbytes, "s": sec, "GB/s": bw / 1e9, "of_copy": bw / copy_bw})
    return rows


def bench_allreduce(iters):
    nccl = dist.new_group(backend="nccl")
    rows = []
    size = 4 << 10
    while size <= 256 << 20:
        x = torch.randn(size // 4, device="cuda")
        its = iters if size <= (16 << 20) else max(10, iters // 5)
        t_tdx = timed(lambda: dist.all_reduce(x), its)
        t_nccl = timed(lambda: dist.all_reduce(x, group=nccl), its)
        rows.append({"bytes": size, "tdx_us": t_tdx * 1e6, "nccl_us": t_nccl * 1e6, "tdx_over_nccl": t_tdx / t_nccl})
        size *= 4
    return rows


class Net(nn.Module):
    def __init__(self, width=2048, depth=8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = F.relu(layer(x))
        return x


def bench_ddp(iters):
    nccl = dist.new_group(backend="nccl")
    x = torch.randn(64, 2048, device="cuda")
    rows = []
    for name, make in [
        ("torch DDP on nccl (anchor)", lambda m: nn.parallel.DistributedDataParallel(m, device_ids=[0],
                                                                                   process_group=nccl)),
        ("torch DDP on tdx", lambda m: nn.parallel.DistributedDataParallel(m, device_ids=[0])),
        ("torchdist_ext DDP on tdx", lambda m: torchdist_ext.DistributedDataParallel(m, device_ids=[0])),
    ]:
        torch.manual_seed(0)
        model = make(Net().cuda())
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step():
            opt.zero_grad(set_to_none=False)
            model(x).square().mean().backward()
            opt.step()
        try:
            rows.append({"ddp": name, "step_ms": timed(step, iters) * 1e3})
        except Exception as e:  # noqa: BLE001 - reported, not hidden
            rows.append({"ddp": name, "error": f"{type(e).__name__}: {e}"})
    anchor = rows[0].get("step_ms")
    for r in rows:
        if anchor and "step_ms" in r:
            r["over_anchor"] = r["step_ms"] / anchor
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu-bench.json")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--kernel-bytes", type=int, default=256 << 20)
    args = ap.parse_args()
    torch.cuda.set_device(0)
    tmp = tempfile.mkdtemp()
    dist.init_process_group("tdx", init_method=f"file://{os.path.join(tmp, 'rdv')}", rank=0, world_size=1)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "kernels": bench_kernels(args.kernel_bytes, args.iters),
              "all_reduce_world1": bench_allreduce(args.iters),
              "ddp_world1": bench_ddp(args.iters)}
    dist.destroy_process_group()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"device: {result['device']}, torch {result['torch']}")
    print("kernels (GB/s of bytes read + written; fraction of the d2d copy measured in the same run):")
    for r in result["kernels"]:
        print(f"  {r['kernel']:34s} {r['GB/s']:8.1f} GB/s  {100 * r['of_copy']:5.1f}%")
    print("all_reduce, world size 1 (median time; tdx / nccl):")
    for r in result["all_reduce_world1"]:
        print(f"  {r['bytes']:>10d} B  tdx {r['tdx_us']:9.1f} us  nccl {r['nccl_us']:9.1f} us  ratio {r['tdx_over_nccl']:.3f}")
    print("DDP step time, world size 1:")
    for r in result["ddp_world1"]:
        print("  " + (f"{r['ddp']:30s} {r['step_ms']:.3f} ms  x{r.get('over_anchor', 1):.3f}" if "step_ms" in r
                      else f"{r['ddp']:30s} {r['error']}"))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
