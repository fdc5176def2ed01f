"""Gradient clipping by the global norm of a sharded model's gradients."""
import math

import torch
import torch.distributed as dist

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(model, max_norm, norm_type=2.0):
    """Scales every shard's gradient so the global ``norm_type`` norm is at most ``max_norm``.

    Each gradient element lives in exactly one rank's shard (padding holds zeros), so the global
    norm is the all-reduced sum of the shards' ``|g|^p`` (the maximum for ``inf``). Every rank gets
    the same norm and the same scale; like ``torch.nn.utils.clip_grad_norm_`` it returns the total
    norm (before clipping) as a tensor.
    """
    from .fully_sharded import FullyShardedDataParallel

    if not isinstance(model, FullyShardedDataParallel):
        raise TypeError(f"clip_grad_norm_: expected a FullyShardedDataParallel model, got {type(model).__name__}; "
                        "for a plain module use torch.nn.utils.clip_grad_norm_")
    max_norm = float(max_norm)
    norm_type = float(norm_type)
    if norm_type <= 0 and norm_type != -math.inf:
        raise ValueError(f"clip_grad_norm_: norm_type={norm_type} must be positive or inf")
    grads = [u.shard.grad for u in model.units if u.shard.grad is not None]
    device = model.units[0].shard.device if model.units else torch.device("cpu")
    if norm_type == math.inf:
        local = max((g.detach().abs().max().float() for g in grads), default=torch.zeros((), device=device))
        total = local.clone().to(device)
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=model.process_group)
    else:
        local = torch.zeros((), dtype=torch.float64, device=device)
        for g in grads:
            local += g.detach().double().abs().pow(norm_type).sum()
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=model.process_group)
        total = local.pow(1.0 / norm_type).float()
    coef = max_norm / (float(total) + 1e-6)
    if coef < 1.0:
        with torch.no_grad():
            for g in grads:
                g.mul_(coef)
    return total
