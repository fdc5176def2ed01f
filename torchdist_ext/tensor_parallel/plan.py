"""``parallelize_module``: apply a tensor-parallel plan (ours or torch's) to a module in place."""
from fnmatch import fnmatch

import torch.distributed as dist
from torch import nn

from ._styles import apply_prepare, read_style
from .layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, mark_sequence_parallel,
                     share_input_region)
from .mesh import Mesh

__all__ = ["parallelize_module", "broadcast_module"]

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


def _expand(module, plan):
    """[(module name, plan key, style)] with torch's wildcards resolved: a key is split at '.', and each
    part is matched with ``fnmatch`` against the children's names (``"layers.*.attn.q"``)."""
    out, unresolved = [], []
    for key, style in plan.items():
        if not isinstance(key, str) or key == "":
            raise ValueError(f"parallelize_module: plan key {key!r} must name a submodule (e.g. 'layers.0.mlp.fc1' "
                             f"or 'layers.*.mlp.fc1'); the module itself cannot be replaced in place")
        found = [("", module)]
        for atom in key.split("."):
            found = [(f"{p}.{n}" if p else n, c) for p, m in found for n, c in m.named_children() if fnmatch(n, atom)]
        if not found:
            unresolved.append(key)
        out.extend((n, key, style) for n, _ in found)
    if unresolved:
        names = sorted(n for n, _ in module.named_modules() if n)
        raise ValueError(f"parallelize_module: plan keys {unresolved} match no submodule of {type(module).__name__}; "
                         f"known names include {names[:20]}")
    seen = {}
    for name, key, _ in out:
        if name in seen:
            raise ValueError(f"parallelize_module: {name!r} is named by plan keys {seen[name]!r} and {key!r}; "
                             f"give each submodule one style")
        seen[name] = key
    return out


def _check_sizes(module, named, name, spec, tp):
    mod = named[name]
    size = None
    if spec.kind == "vocab":
        size = "num_embeddings" if isinstance(mod, nn.Embedding) else "out_features"
    elif spec.kind in ("colwise", "rowwise"):
        size = "out_features" if spec.kind == "colwise" else "in_features"
    if size is not None and getattr(mod, size) % tp:
        raise ValueError(f"parallelize_module: {name}.{size} = {getattr(mod, size)} is not divisible by the "
                         f"tensor-parallel degree {tp}")
    if spec.replaces:
        parent_name = name.rpartition(".")[0]
        for attr in _HEAD_ATTRS:
            heads = getattr(named[parent_name], attr, None)
            if isinstance(heads, int) and heads % tp:
                raise ValueError(f"parallelize_module: {parent_name or 'the module'}.{attr} = {heads} is not "
                                 f"divisible by the tensor-parallel degree {tp}")


def _split_dims(spec):
    """{parameter name: dim it is split along, None: replicated} of the layer a Spec builds."""
    if spec.kind == "rowwise":
        return {"weight": 1, "bias": None}
    return {"weight": 0, "bias": 0}


def _ties(module, specs):
    """[[(module name, param name), ...]] for each parameter shared by several places that the plan
    splits; raises ValueError unless every place is a replaced layer splitting it the same way."""
    owners = {}
    for full, p in module.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(full.rpartition("."))
    ties = []
    for places in owners.values():
        splits = {}
        for mod_name, _, pname in places:
            spec = specs.get(mod_name)
            splits[f"{mod_name}.{pname}" if mod_name else pname] = (
                _split_dims(spec).get(pname) if spec is not None and spec.replaces else "replicated")
        if len(places) < 2 or set(splits.values()) == {"replicated"}:
            continue
        dims = set(splits.values())
        if len(dims) > 1 or None in dims:
            how = ", ".join(f"{k} {'by dim ' + str(d) if isinstance(d, int) else 'replicated'}"
                            for k, d in splits.items())
            raise ValueError(f"parallelize_module: {sorted(splits)} are one tied parameter but the plan does not "
                             f"split every use of it the same way ({how}); split all of them alike (e.g. a "
                             f"'vocab' embedding and a 'vocab' head share one shard) or untie them")
        ties.append([(m, pn) for m, _, pn in places])
    return ties


def _mesh_for(tp_group_or_mesh, group, module):
    """A 1-D DeviceMesh over the TP group, for layers handing on DTensors."""
    from torch.distributed.device_mesh import DeviceMesh
    if isinstance(tp_group_or_mesh, DeviceMesh):
        names = tp_group_or_mesh.mesh_dim_names or ()
        return tp_group_or_mesh["tp"] if "tp" in names and tp_group_or_mesh.ndim > 1 else tp_group_or_mesh
    p = next(module.parameters(), None)
    device = p.device.type if p is not None else "cpu"
    return DeviceMesh.from_group(group if group is not None else dist.group.WORLD, device)


def _hand_on_dtensor(layer, mesh, placement):
    from torch.distributed.tensor import DTensor

    def hook(module, args, out):
        return DTensor.from_local(out, mesh, (placement,), run_check=False)
    layer.register_forward_hook(hook)


def _build(mod, spec, group):
    if isinstance(mod, nn.Embedding):
        return VocabParallelEmbedding.from_module(mod, group, **spec.layer)
    if spec.kind == "rowwise":
        return RowParallelLinear.from_module(mod, group, **spec.layer)
    return ColumnParallelLinear.from_module(mod, group, **spec.layer)  # colwise, or a vocab head


def broadcast_module(module, group=None, src=0):
    """Makes every parameter and buffer of ``module`` equal to those of rank ``src`` of ``group`` (a
    group rank), in place, with coalesced broadcasts."""
    tensors = [t.detach() for t in list(module.parameters()) + list(module.buffers())]
    if tensors:
        dist._broadcast_coalesced(group if group is not None else dist.group.WORLD, tensors, 64 << 20, src)


def parallelize_module(module, tp_group_or_mesh=None, plan=None, sequence_parallel=False, *, src_data_rank=0,
                       device_mesh=None, parallelize_plan=None):
    """Replaces the submodules named in ``plan`` with their tensor-parallel versions, in place.

    tp_group_or_mesh: a ProcessGroup, a torchdist_ext ``Mesh`` (its TP group) or a DeviceMesh (a 1-D
        one, or its dim named "tp"); None: the default group. ``device_mesh=`` is torch's name for it.
    plan: {submodule name: style} (``parallelize_plan=`` is torch's name for it, so torch's keyword
    calls run unchanged). Names may hold torch's wildcards, matched part by part
    (``"layers.*.attn.q"``). A style is "colwise" (ColumnParallelLinear, output kept split),
    "rowwise" (RowParallelLinear on an nn.Linear, VocabParallelEmbedding on an nn.Embedding), "vocab"
    (VocabParallelEmbedding, or an output head whose logits stay split for
    ``vocab_parallel_cross_entropy``), "sequence" (a replicated LayerNorm/dropout on a sequence shard),
    or torch's ``ColwiseParallel`` / ``RowwiseParallel`` / ``SequenceParallel`` /
    ``PrepareModuleInput`` / ``PrepareModuleOutput`` / ``PrepareModuleInputOutput`` (layouts Shard(1)
    mean sequence parallelism; ``use_local_output=False`` on a linear hands its output on as a
    DTensor, e.g. to torch's ``loss_parallel``).
    sequence_parallel: for string styles, colwise layers all-gather a sequence-sharded input and
        rowwise layers reduce-scatter their output.
    src_data_rank: as torch's, the TP-group rank whose parameters and buffers every rank takes
        (all of ``module``'s, replicated ones included) before slicing; None keeps each rank's own.

    The whole plan (names, wildcards, styles, module types, divisibility, tied parameters) is checked
    before anything is changed or communicated: a bad plan raises and leaves ``module`` untouched.
    A parameter tied between layers that split it alike (a vocab-parallel embedding and head) stays
    one parameter holding one shard; other ties into split layers are refused. Column-parallel
    siblings (Q, K, V) share one communication of their common input (``share_input_region`` on
    their parent). Returns ``module``.
    """
    if device_mesh is not None:
        if tp_group_or_mesh is not None:
            raise TypeError("parallelize_module: got both tp_group_or_mesh and device_mesh (torch's name for it); "
                            "pass one")
        tp_group_or_mesh = device_mesh
    if parallelize_plan is not None:
        if plan is not None:
            raise TypeError("parallelize_module: got both plan and parallelize_plan (torch's name for it); pass one")
        plan = parallelize_plan
    group = _resolve_group(tp_group_or_mesh)
    tp = dist.get_world_size(group)
    if not isinstance(plan, dict):
        raise TypeError(f"parallelize_module: plan must be a dict {{submodule name: style}}, got {type(plan).__name__}")
    if src_data_rank is not None and (not isinstance(src_data_rank, int) or not 0 <= src_data_rank < tp):
        raise ValueError(f"parallelize_module: src_data_rank = {src_data_rank!r} is not a rank of the "
                         f"tensor-parallel group (0..{tp - 1}) nor None")
    named = dict(module.named_modules())
    specs = {}
    for name, _, style in _expand(module, plan):
        spec = read_style(name, style, sequence_parallel, named[name])
        _check_sizes(module, named, name, spec, tp)
        specs[name] = spec
    ties = _ties(module, specs)
    mesh = _mesh_for(tp_group_or_mesh, group, module) if any(s.dtensor_out for s in specs.values()) else None
    # --- everything is checked: from here on the module changes ---
    if src_data_rank is not None:
        broadcast_module(module, group, src_data_rank)
    built, columns = {}, {}
    for name, spec in specs.items():
        mod = named[name]
        if spec.kind == "sequence":
            mark_sequence_parallel(mod, group)
        elif spec.kind == "prepare":
            apply_prepare(mod, name, spec, group)
        else:
            built[name] = layer = _build(mod, spec, group)
            if spec.dtensor_out is not None:
                _hand_on_dtensor(layer, mesh, spec.dtensor_out)
            if isinstance(layer, ColumnParallelLinear):
                parent_name = name.rpartition(".")[0]
                columns[parent_name] = columns.get(parent_name, 0) + 1
    for places in ties:  # the first layer's shard becomes every tied use's parameter
        shard = getattr(built[places[0][0]], places[0][1])
        for mod_name, pname in places[1:]:
            setattr(built[mod_name], pname, shard)
    for name, layer in built.items():
        parent_name, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(parent_name), leaf, layer)
    for parent_name, n in columns.items():
        if n > 1:  # Q, K, V reading one input: one all-reduce of its gradient (Megatron's fused QKV)
            share_input_region(module.get_submodule(parent_name))
    return module
