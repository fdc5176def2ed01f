"""Gradient clipping by the global norm of a sharded model's gradients."""
from .fully_sharded import FullyShardedDataParallel

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(model, max_norm, norm_type=2.0):
    """Scales every shard's gradient so the global ``norm_type`` norm is at most ``max_norm``.

    Each gradient element lives in exactly one rank's shard (padding holds zeros), so the global
    norm is the all-reduced sum of the shards' ``|g|^p`` (the maximum for ``inf``). Every rank gets
    the same norm and the same scale; like ``torch.nn.utils.clip_grad_norm_`` it returns the total
    norm (before clipping) as a tensor. The same as ``model.clip_grad_norm_(max_norm, norm_type)``.
    """
    if not isinstance(model, FullyShardedDataParallel):
        raise TypeError(f"clip_grad_norm_: expected a FullyShardedDataParallel model, got {type(model).__name__}; "
                        "for a plain module use torch.nn.utils.clip_grad_norm_")
    return model.clip_grad_norm_(max_norm, norm_type)
