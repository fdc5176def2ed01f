"""Sharded checkpoints: every rank writes its own shards atomically, rank 0 a manifest; loading
maps the saved shards onto any world size (4 -> 2 -> 3 ...), optimizer state included.

Layout of a checkpoint directory::

    manifest.json                      # written last, by rank 0, after every shard file exists
    shard-00000-of-00004.pt ...        # per rank: unit shards, optimizer state of those shards

Each file is written to a temporary name in the same directory and renamed with os.replace, so a
reader never sees a half-written file and a checkpoint without manifest.json is incomplete.
"""
import json
import os
import tempfile

import torch
import torch.distributed as dist

from .. import _C

__all__ = ["save_sharded_checkpoint", "load_sharded_checkpoint"]

MANIFEST = "manifest.json"
FORMAT = "torchdist_ext.fsdp.sharded/1"


def _shard_file(rank, world):
    return f"shard-{rank:05d}-of-{world:05d}.pt"


def _atomic_write(path, write):
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _check_model(model, fn):
    from .fully_sharded import FullyShardedDataParallel

    if not isinstance(model, FullyShardedDataParallel):
        raise TypeError(f"{fn}: expected a FullyShardedDataParallel model, got {type(model).__name__}")


def _split_optimizer_state(optimizer, shard):
    """The optimizer's state of one shard parameter: shard-shaped tensors vs everything else."""
    if optimizer is None:
        return None
    state = optimizer.state.get(shard, {})
    sharded, replicated = {}, {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor) and v.shape == shard.shape:
            sharded[k] = v.detach().cpu()
        else:
            replicated[k] = v.detach().cpu() if isinstance(v, torch.Tensor) else v
    return {"sharded": sharded, "replicated": replicated}


def save_sharded_checkpoint(model, path, optimizer=None):
    """Saves ``model``'s shards (and ``optimizer``'s state of them) under directory ``path``.

    Collective: every rank of the model's group calls it. Returns the manifest (a dict).
    """
    _check_model(model, "save_sharded_checkpoint")
    group = model.process_group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier(group=group)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"save_sharded_checkpoint: directory {path!r} does not exist on rank {rank} "
                                "(ranks on several hosts need a shared file system)")
    units = []
    for unit in model.units:
        units.append({"shard": unit.shard.detach().cpu(), "optim": _split_optimizer_state(optimizer, unit.shard)})
    payload = {"format": FORMAT, "rank": rank, "world_size": world, "units": units}
    if rank == 0:
        payload["buffers"] = {n: b.detach().cpu() for n, b in model.module.named_buffers()}
        if optimizer is not None:
            payload["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    _atomic_write(os.path.join(path, _shard_file(rank, world)), lambda f: torch.save(payload, f))
    dist.barrier(group=group)  # every shard file exists before the manifest appears
    manifest = {"format": FORMAT, "world_size": world, "stage": model.stage, "has_optimizer": optimizer is not None,
                "files": [_shard_file(r, world) for r in range(world)],
                "units": [u.describe() for u in model.units]}
    if rank == 0:
        _atomic_write(os.path.join(path, MANIFEST), lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    dist.barrier(group=group)
    return manifest


def _read_manifest(path):
    mpath = os.path.join(path, MANIFEST)
    if not os.path.exists(mpath):
        raise FileNotFoundError(f"load_sharded_checkpoint: {mpath} does not exist; {path!r} is not a complete "
                                "sharded checkpoint (the manifest is written last, after every shard)")
    with open(mpath) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"load_sharded_checkpoint: {mpath} has format {manifest.get('format')!r}, expected {FORMAT!r}")
    missing = [f for f in manifest["files"] if not os.path.exists(os.path.join(path, f))]
    if missing:
        raise ValueError(f"load_sharded_checkpoint: the checkpoint was saved by {manifest['world_size']} ranks but "
                         f"{missing} are missing from {path!r}, so it cannot be mapped to any world size; copy the "
                         "whole directory")
    return manifest


def _check_units(model, manifest):
    saved = manifest["units"]
    mine = [u.describe() for u in model.units]
    if len(saved) != len(mine):
        raise ValueError(f"load_sharded_checkpoint: the checkpoint has {len(saved)} wrapped units but this model has "
                         f"{len(mine)}; wrap the model with the same auto_wrap_policy it was saved with")
    for i, (s, m) in enumerate(zip(saved, mine)):
        if s != m:
            diff = next((k for k in m if s.get(k) != m[k]), "?")
            raise ValueError(f"load_sharded_checkpoint: unit {i} differs in {diff}: checkpoint {s.get(diff)} vs model "
                             f"{m[diff]}; the checkpoint cannot be mapped onto this model")


def load_sharded_checkpoint(model, path, optimizer=None):
    """Loads a checkpoint written by save_sharded_checkpoint into ``model`` (and ``optimizer``),
    whatever world size it was saved with: each rank reads only the pieces of the saved shards
    that fall into its own shards (``_C.FlatLayout.reshard_pieces``). Collective.
    """
    _check_model(model, "load_sharded_checkpoint")
    group = model.process_group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    manifest = _read_manifest(path)
    _check_units(model, manifest)
    if optimizer is not None and not manifest["has_optimizer"]:
        raise ValueError(f"load_sharded_checkpoint: {path!r} holds no optimizer state (saved without optimizer=); "
                         "pass optimizer=None")
    old_world = manifest["world_size"]
    files = {}

    def shard_file(r):
        if r not in files:
            files[r] = torch.load(os.path.join(path, manifest["files"][r]), map_location="cpu", mmap=True,
                                  weights_only=False)
        return files[r]

    for i, unit in enumerate(model.units):
        src = _C.FlatLayout(list(unit.layout.numels), unit.layout.alignment, old_world)
        pieces = src.reshard_pieces(unit.layout, rank)

        def assemble(get):
            out = torch.zeros(unit.layout.shard_numel, dtype=unit.shard.dtype)
            for src_rank, src_off, length, dst_off in pieces:
                out[dst_off:dst_off + length] = get(shard_file(src_rank)["units"][i])[src_off:src_off + length]
            return out

        with torch.no_grad():
            unit.shard.copy_(assemble(lambda u: u["shard"]))  # bumps the version: next forward re-gathers
        if optimizer is not None:
            saved = shard_file(0)["units"][i]["optim"]
            state = {}
            for k in saved["sharded"]:
                state[k] = assemble(lambda u, k=k: u["optim"]["sharded"][k]).to(unit.shard.device)
            for k, v in saved["replicated"].items():
                state[k] = v.clone() if isinstance(v, torch.Tensor) else v
            if state:
                optimizer.state[unit.shard] = state
    buffers = shard_file(0).get("buffers", {})
    with torch.no_grad():
        for name, buf in model.module.named_buffers():
            if name in buffers:
                buf.copy_(buffers[name])
    if optimizer is not None:
        groups = shard_file(0).get("param_groups", [])
        if len(groups) != len(optimizer.param_groups):
            raise ValueError(f"load_sharded_checkpoint: the checkpoint's optimizer has {len(groups)} param groups but "
                             f"this one has {len(optimizer.param_groups)}")
        for g, saved in zip(optimizer.param_groups, groups):
            g.update(saved)
    files.clear()
    dist.barrier(group=group)
