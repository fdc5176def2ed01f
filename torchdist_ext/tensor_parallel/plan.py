"""``parallelize_module``: apply a tensor-parallel plan (ours or torch's) to a module in place."""
import torch.distributed as dist
from torch import nn

from .layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, mark_sequence_parallel,
                     share_input_region)
from .mesh import Mesh

__all__ = ["parallelize_module"]

_STYLES = ("colwise", "rowwise", "vocab", "sequence")
_HEAD_ATTRS = ("num_heads", "n_heads", "n_head", "num_attention_heads")


def _resolve_group(g):
    if g is None or isinstance(g, dist.ProcessGroup):
        return g
    if isinstance(g, Mesh):
        return g.tp_group
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover
        DeviceMesh = ()
    if isinstance(g, DeviceMesh):
        names = g.mesh_dim_names or ()
        if "tp" in names:
            return g.get_group("tp")
        if g.ndim == 1:
            return g.get_group()
        raise ValueError(f"parallelize_module: a {g.ndim}-D DeviceMesh needs a dim named 'tp', got {names}")
    raise TypeError(f"parallelize_module: tp_group_or_mesh must be a ProcessGroup, a torchdist_ext Mesh or a "
                    f"DeviceMesh, got {type(g).__name__}")


def _layouts(style):
    """(style name, sequence_parallel, gather_output / input_is_parallel) from torch's style objects."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
    name = type(style).__name__
    if isinstance(style, SequenceParallel):
        # use_local_output is accepted either way: our layers always return plain (local) tensors.
        if tuple(style.sequence_sharding) != (Shard(1),):
            raise ValueError(f"parallelize_module: SequenceParallel(sequence_dim={style.sequence_sharding[0].dim}) "
                             f"is not supported; use sequence_dim=1 (activations shaped batch x seq x hidden)")
        return "sequence", True, None
    if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
        raise TypeError(f"parallelize_module: plan value {name} is not supported; use 'colwise', 'rowwise', "
                        f"'vocab', 'sequence' or torch's ColwiseParallel/RowwiseParallel/SequenceParallel")
    if not style.use_local_output:
        raise ValueError(f"parallelize_module: {name}(use_local_output=False) is not supported: our layers "
                         f"return plain tensors")
    inp, out = style.input_layouts[0], style.output_layouts[0]
    if isinstance(style, ColwiseParallel):
        if inp not in (Replicate(), Shard(1)) or out not in (Shard(-1), Replicate()):
            raise ValueError(f"parallelize_module: ColwiseParallel(input_layouts={inp}, output_layouts={out}) is "
                             f"not supported; inputs Replicate() or Shard(1), outputs Shard(-1) or Replicate()")
        return "colwise", inp == Shard(1), out == Replicate()
    if inp not in (Shard(-1), Replicate()) or out not in (Replicate(), Shard(1)):
        raise ValueError(f"parallelize_module: RowwiseParallel(input_layouts={inp}, output_layouts={out}) is "
                         f"not supported; inputs Shard(-1) or Replicate(), outputs Replicate() or Shard(1)")
    return "rowwise", out == Shard(1), inp == Shard(-1)


def _normalize(style, sequence_parallel):
    if isinstance(style, str):
        if style not in _STYLES:
            raise ValueError(f"parallelize_module: plan value {style!r} is not one of {_STYLES}")
        if style == "sequence" and not sequence_parallel:
            raise ValueError("parallelize_module: 'sequence' marks a module running on a sequence shard; pass "
                             "sequence_parallel=True (or drop it: without sequence parallelism LayerNorms stay "
                             "replicated and unmarked)")
        default = {"colwise": False, "rowwise": True}.get(style)
        return style, sequence_parallel, default
    return _layouts(style)


def _build(mod, name, style, sp, flag, group):
    if style == "sequence":
        return mark_sequence_parallel(mod, group)
    if isinstance(mod, nn.Embedding) and style in ("vocab", "rowwise"):
        return VocabParallelEmbedding.from_module(mod, group, sequence_parallel=sp)
    if not isinstance(mod, nn.Linear):
        raise TypeError(f"parallelize_module: {name!r} is a {type(mod).__name__}; {style!r} applies to "
                        f"nn.Linear{' or nn.Embedding' if style == 'vocab' else ''}")
    if style == "colwise":
        return ColumnParallelLinear.from_module(mod, group, gather_output=bool(flag), sequence_parallel=sp)
    if style == "vocab":  # output head: logits kept split by vocabulary for vocab_parallel_cross_entropy
        return ColumnParallelLinear.from_module(mod, group, sequence_parallel=sp)
    return RowParallelLinear.from_module(mod, group, input_is_parallel=bool(flag), sequence_parallel=sp)


def parallelize_module(module, tp_group_or_mesh, plan, sequence_parallel=False):
    """Replaces the submodules named in ``plan`` with their tensor-parallel versions, in place.

    plan: {submodule name: style}; a style is "colwise" (ColumnParallelLinear, output kept split),
    "rowwise" (RowParallelLinear on an nn.Linear, VocabParallelEmbedding on an nn.Embedding), "vocab"
    (VocabParallelEmbedding, or an output head whose logits stay split for
    ``vocab_parallel_cross_entropy``), "sequence" (a replicated LayerNorm/dropout on a sequence shard),
    or torch's ``ColwiseParallel()`` / ``RowwiseParallel()`` / ``SequenceParallel()`` (input/output
    layouts Shard(1) mean sequence parallelism). sequence_parallel: for string styles, colwise layers
    all-gather a sequence-sharded input and rowwise layers reduce-scatter their output.
    Parameters are sliced from the module's current (full) weights. Column-parallel siblings (Q, K,
    V) share one communication of their common input (``share_input_region`` on their parent). Every name, type and divisibility
    is checked before any layer is built. Returns ``module``.
    """
    group = _resolve_group(tp_group_or_mesh)
    tp = dist.get_world_size(group)
    named = dict(module.named_modules())
    missing = [n for n in plan if n not in named or n == ""]
    if missing:
        raise ValueError(f"parallelize_module: plan names {missing} which are not submodules of "
                         f"{type(module).__name__}; known names include {sorted(n for n in named if n)[:20]}")
    todo = []
    for name, style in plan.items():
        style, sp, flag = _normalize(style, sequence_parallel)
        mod = named[name]
        size = {"colwise": "out_features", "rowwise": "in_features"}.get(style)
        if isinstance(mod, nn.Embedding) or style == "vocab":
            size = "num_embeddings" if isinstance(mod, nn.Embedding) else "out_features"
        if size is not None and getattr(mod, size, 0) % tp:
            raise ValueError(f"parallelize_module: {name}.{size} = {getattr(mod, size)} is not divisible by the "
                             f"tensor-parallel degree {tp}")
        parent_name = name.rpartition(".")[0]
        for attr in _HEAD_ATTRS:
            heads = getattr(named[parent_name], attr, None)
            if isinstance(heads, int) and heads % tp:
                raise ValueError(f"parallelize_module: {parent_name or 'the module'}.{attr} = {heads} is not "
                                 f"divisible by the tensor-parallel degree {tp}")
        todo.append((name, style, sp, flag))
    columns = {}
    for name, style, sp, flag in todo:
        parent_name, _, leaf = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        setattr(parent, leaf, _build(named[name], name, style, sp, flag, group))
        if isinstance(getattr(parent, leaf), ColumnParallelLinear):
            columns[parent_name] = columns.get(parent_name, 0) + 1
    for parent_name, n in columns.items():
        if n > 1:  # Q, K, V reading one input: one all-reduce of its gradient (Megatron's fused QKV)
            share_input_region(module.get_submodule(parent_name))
    return module
