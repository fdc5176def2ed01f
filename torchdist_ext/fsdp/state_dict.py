"""Full (unsharded) state dicts of a sharded model: gathered on rank 0 one unit at a time
(full_state_dict) and loaded back into the shards one unit at a time (load_full_state_dict)."""
from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch.nn.modules.module import _IncompatibleKeys

__all__ = ["full_state_dict", "load_full_state_dict"]


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


def _problems(state_dict, model, param_shapes, buffer_shapes, strict):
    """What is wrong with ``state_dict`` for ``model`` (a sentence), or None; and the keys present."""
    if not isinstance(state_dict, Mapping):
        return (f"expected a state dict (a mapping from the original module's keys to tensors), got "
                f"{type(state_dict).__name__}"), []
    expected = model._orig_keys
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in set(expected)]
    msgs = []
    not_tensors = [k for k in expected if k in state_dict and not isinstance(state_dict[k], torch.Tensor)]
    if not_tensors:
        msgs.append(f"values that are not tensors for {not_tensors}")
    shapes = {**param_shapes, **buffer_shapes}
    bad = [f"{k}: state dict {list(state_dict[k].shape)} vs model {list(shapes[k])}" for k in expected
           if k in state_dict and k not in not_tensors and tuple(state_dict[k].shape) != tuple(shapes[k])]
    if bad:
        msgs.append("size mismatch for " + "; ".join(bad))
    if strict and missing:
        msgs.append(f"missing keys {missing}")
    if strict and unexpected:
        msgs.append(f"unexpected keys {unexpected}")
    if strict and (missing or unexpected):
        msgs.append("pass the module's own full state dict (e.g. from full_state_dict or the plain module's "
                    "state_dict()), or strict=False to load only the keys that match")
    return ("; ".join(msgs) or None), [k for k in expected if k in state_dict]


def _agree(problem, present, group, broadcast_from_rank0):
    """Every rank learns the same verdict, so that either all raise or all load (never a hang)."""
    world = dist.get_world_size(group)
    if broadcast_from_rank0:
        box = [problem, present]
        if world > 1:
            dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        problem, present = box
        if problem is not None:
            raise ValueError(f"load_full_state_dict: rank 0's state dict does not fit the model: {problem}")
        return present
    everyone = [(problem, present)] * world
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, (problem, present), group=group)
    bad = [(r, p) for r, (p, _) in enumerate(everyone) if p is not None]
    if bad:
        raise ValueError("load_full_state_dict: the state dict does not fit the model on "
                         + "; ".join(f"rank {r}: {p}" for r, p in bad))
    if any(set(k) != set(present) for _, k in everyone):
        raise ValueError("load_full_state_dict: ranks passed state dicts with different keys; pass the same dict on "
                         "every rank, or pass it on rank 0 only with broadcast_from_rank0=True")
    return present


def _piece_from(state_dict, unit, present, begin, end):
    """This rank's slice [begin, end) of the unit's flat buffer, built from ``state_dict`` without
    materializing the whole flat buffer (present parameters only; the rest stays zero)."""
    piece = torch.zeros(end - begin, dtype=unit.dtype)
    for off, numel, names in zip(unit.layout.offsets, unit.layout.numels, unit.names):
        name = next((n for n in names if n in present), None)
        lo, hi = max(off, begin), min(off + numel, end)
        if name is None or lo >= hi:
            continue
        value = state_dict[name].detach().reshape(-1)
        piece[lo - begin:hi - begin].copy_(value[lo - off:hi - off])
    return piece


def load_full_state_dict(model, state_dict, *, strict=True, broadcast_from_rank0=False):
    """Loads a full (unsharded, original keys) state dict into a sharded model of any stage.

    The counterpart of :func:`full_state_dict` and of torch's
    ``set_model_state_dict(model, sd, options=StateDictOptions(full_state_dict=True,
    broadcast_from_rank0=...))``. Each rank copies its own slice of every unit's flat parameter
    into its shard, one unit at a time, so besides the dict no rank holds more than one unit's
    slice (with ``broadcast_from_rank0``, rank 0 holds one unit's whole flat buffer while it
    scatters it). Buffers are loaded too (cast to the model's buffer dtypes). Optimizer state is
    not touched; the next forward gathers the new parameters.

    Args:
        model: a FullyShardedDataParallel model.
        state_dict: the module's full state dict (e.g. ``plain_module.state_dict()`` or
            :func:`full_state_dict`'s result), on every rank; with ``broadcast_from_rank0=True``
            only rank 0's is read (other ranks may pass ``None``).
        strict: as ``nn.Module.load_state_dict``: missing or unexpected keys are an error; with
            False they are skipped (missing entries keep their current values) and reported.
        broadcast_from_rank0: rank 0 sends every rank its slices (scatter per unit).

    Returns ``NamedTuple(missing_keys, unexpected_keys)`` as ``load_state_dict``. Raises ValueError
    on every rank (never a hang) naming the keys when the dict does not fit: missing or unexpected
    keys (strict), a shape that differs from the model's, a value that is not a tensor.
    """
    from .fully_sharded import FullyShardedDataParallel

    if not isinstance(model, FullyShardedDataParallel):
        raise TypeError(f"load_full_state_dict: expected a FullyShardedDataParallel model, got "
                        f"{type(model).__name__}")
    group = model.process_group
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    root = dist.get_global_rank(group, 0)
    has = rank == 0 or not broadcast_from_rank0
    param_shapes = {n: s for u in model.units for names, s in zip(u.names, u.shapes) for n in names}
    persistent = set(model._orig_keys)
    buffers = {n: b for n, b in model.module.named_buffers() if n in persistent}
    buffer_shapes = {n: tuple(b.shape) for n, b in buffers.items()}
    problem, present = _problems(state_dict, model, param_shapes, buffer_shapes, strict) if has else (None, [])
    present = set(_agree(problem, present, group, broadcast_from_rank0))

    with torch.no_grad():
        for unit in model.units:
            begin, end = unit.layout.shard_range(rank)
            if not broadcast_from_rank0:
                piece = _piece_from(state_dict, unit, present, begin, end)
            else:
                piece = torch.empty(end - begin, dtype=unit.dtype, device=unit.compute_device)
                if world == 1:
                    piece.copy_(_piece_from(state_dict, unit, present, 0, unit.layout.padded_numel))
                else:
                    chunks = None
                    if rank == 0:
                        flat = _piece_from(state_dict, unit, present, 0, unit.layout.padded_numel)
                        chunks = [c.to(unit.compute_device) for c in flat.chunk(world)]
                    dist.scatter(piece, scatter_list=chunks, src=root, group=group)
                    chunks = flat = None
            unit.invalidate()  # every rank regathers, also one whose shard is only padding
            shard = unit.shard.detach()
            for off, numel, names in zip(unit.layout.offsets, unit.layout.numels, unit.names):
                lo, hi = max(off, begin), min(off + numel, end)
                if lo < hi and any(n in present for n in names):
                    shard[lo - begin:hi - begin].copy_(piece[lo - begin:hi - begin])
            del piece
        for name, buf in buffers.items():
            if name not in present:
                continue
            if has:
                buf.copy_(state_dict[name].detach())
            if broadcast_from_rank0 and world > 1:
                dist.broadcast(buf, src=root, group=group)
    expected = set(model._orig_keys)
    missing = [k for k in model._orig_keys if k not in present]
    unexpected = [k for k in state_dict if k not in expected] if has and isinstance(state_dict, Mapping) else []
    return _IncompatibleKeys(missing, unexpected)
