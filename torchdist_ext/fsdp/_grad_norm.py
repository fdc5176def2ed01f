"""Clipping the gradients of flat-parameter shards by their global norm (for FullyShardedDataParallel)."""
import math

import torch
import torch.distributed as dist


def clip_shard_grads_(units, group, max_norm, norm_type):
    """Scales every unit's shard gradient so the global ``norm_type`` norm is at most ``max_norm``.

    Each gradient element lives in exactly one rank's shard (padding holds zeros), so the global
    norm is the all-reduced sum of the shards' ``|g|^p`` over ``group`` (the maximum for ``inf``).
    Every rank gets the same norm and the same scale. Returns the total norm (before clipping) as a
    tensor.
    """
    max_norm = float(max_norm)
    norm_type = float(norm_type)
    if norm_type <= 0 and norm_type != -math.inf:
        raise ValueError(f"clip_grad_norm_: norm_type={norm_type} must be positive or inf")
    grads = [u.shard.grad for u in units if u.shard.grad is not None]
    device = units[0].shard.device if units else torch.device("cpu")
    if norm_type == math.inf:
        local = max((g.detach().abs().max().float() for g in grads), default=torch.zeros((), device=device))
        total = local.clone().to(device)
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    else:
        local = torch.zeros((), dtype=torch.float64, device=device)
        for g in grads:
            local += g.detach().double().abs().pow(norm_type).sum()
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
        total = local.pow(1.0 / norm_type).float()
    coef = max_norm / (float(total) + 1e-6)
    if coef < 1.0:
        with torch.no_grad():
            for g in grads:
                g.mul_(coef)
    return total
