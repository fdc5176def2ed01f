"""The full (unsharded) state dict of a sharded model, gathered on rank 0 one unit at a time."""
import torch
import torch.distributed as dist

__all__ = ["full_state_dict"]


def full_state_dict(model, rank0_only=True):
    """Returns the module's state dict with its original keys, on rank 0 (``{}`` elsewhere).

    Units are gathered to rank 0 one at a time (``dist.gather`` of the shards), each parameter
    copied out and the gathered buffer dropped before the next unit, so besides the result rank 0
    holds at most one unit's full flat buffer and other ranks nothing extra. Values are in the
    parameters' and buffers' original dtypes, on the CPU: the dict loads into the plain module with
    ``load_state_dict``. ``rank0_only=False`` returns it on every rank (all_gather instead).
    """
    from .fully_sharded import FullyShardedDataParallel

    if not isinstance(model, FullyShardedDataParallel):
        raise TypeError(f"full_state_dict: expected a FullyShardedDataParallel model, got {type(model).__name__}")
    group = model.process_group
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    root = dist.get_global_rank(group, 0)
    keep = rank == 0 or not rank0_only
    values = {}
    for unit in model.units:
        shard = unit.shard.detach()
        if rank0_only:
            pieces = [torch.empty_like(shard) for _ in range(world)] if rank == 0 else None
            dist.gather(shard, gather_list=pieces, dst=root, group=group)
            flat = torch.cat(pieces) if rank == 0 else None
        else:
            flat = torch.empty(unit.layout.padded_numel, dtype=shard.dtype, device=shard.device)
            (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(flat, shard.contiguous(), group=group)
        if keep:
            for names, tensor in unit.full_params_from(flat):
                value = tensor.detach().to("cpu", copy=True)
                for name in names:
                    values[name] = value
        del flat
    if not keep:
        return {}
    persistent = set(model._orig_keys)
    for name, buf in model.module.named_buffers():
        if name in persistent:
            values[name] = buf.detach().to("cpu", dtype=model._buffer_dtypes.get(name, buf.dtype), copy=True)
    missing = [k for k in model._orig_keys if k not in values]
    if missing:
        raise RuntimeError(f"full_state_dict: no value found for {missing}; this is a bug in torchdist_ext.fsdp")
    return {k: values[k] for k in model._orig_keys}
