"""Checkpoints in tensor-parallel layout: per-rank state_dicts plus a layout, convertible to the
unsplit model's state_dict and to any other TP degree without communication."""
import torch

__all__ = ["tp_layout", "merge_shards", "shard_state_dict"]


def tp_layout(module):
    """{state_dict key: dim along which it is split across the TP group} for split tensors; keys not
    listed are replicated. Save it next to each rank's ``module.state_dict()``."""
    layout = {}
    for prefix, mod in module.named_modules():
        for pname, dim in getattr(mod, "_tp_dims", {}).items():
            if getattr(mod, pname, None) is not None:
                layout[f"{prefix}.{pname}" if prefix else pname] = dim
    return layout


def merge_shards(state_dicts, layout):
    """The unsplit state_dict from the per-rank ``state_dicts`` (in TP-rank order) and ``layout``."""
    if not state_dicts:
        raise ValueError("merge_shards: state_dicts is empty; pass one state_dict per TP rank, in rank order")
    keys = list(state_dicts[0])
    for r, sd in enumerate(state_dicts):
        if list(sd) != keys:
            raise ValueError(f"merge_shards: rank {r}'s keys differ from rank 0's: "
                             f"{sorted(set(sd) ^ set(keys))[:10]}")
    return {k: (torch.cat([sd[k] for sd in state_dicts], layout[k]) if k in layout else state_dicts[0][k])
            for k in keys}


def shard_state_dict(full, layout, tp, rank):
    """This rank's slice of the unsplit state_dict ``full`` for TP degree ``tp``."""
    out = {}
    for k, v in full.items():
        if k in layout:
            if v.shape[layout[k]] % tp:
                raise ValueError(f"shard_state_dict: {k} has size {v.shape[layout[k]]} along dim {layout[k]}, "
                                 f"not divisible by the tensor-parallel degree {tp}")
            v = v.chunk(tp, layout[k])[rank].clone()
        out[k] = v
    return out
