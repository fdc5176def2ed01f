"""Plan values (our strings and torch's ParallelStyle objects) read into one ``Spec`` per module, and
torch's PrepareModuleInput / PrepareModuleOutput carried out on plain tensors.

Tensors between our modules are plain local tensors whose gradients are complete (never partial
sums): a layout change is then one operator whose backward is the reverse change. Shard(d) to
Replicate() all-gathers along d (backward keeps this rank's slice); Replicate() to Shard(d) keeps
this rank's chunk (backward all-gathers).
"""
from torch import nn

from ._comm import gather_seq, split_seq

_STRINGS = ("colwise", "rowwise", "vocab", "sequence")


class Spec:
    """What a plan entry does to its module, decided before anything is changed.

    kind: "colwise", "rowwise", "vocab" (embedding or head), "sequence" or "prepare".
    layer: keyword arguments for the replacing layer's ``from_module``.
    dtensor_out: a placement when the layer's output is handed on as a DTensor (torch's
        ``use_local_output=False``, e.g. a head for ``loss_parallel``); None for a plain tensor.
    inputs / kwarg_inputs / outputs: (from, to) layout pairs of a PrepareModule* style.
    """

    def __init__(self, kind, layer=None, dtensor_out=None, inputs=None, kwarg_inputs=None, outputs=None):
        self.kind, self.layer, self.dtensor_out = kind, layer or {}, dtensor_out
        self.inputs, self.kwarg_inputs, self.outputs = inputs, kwarg_inputs or {}, outputs

    @property
    def replaces(self):
        return self.kind in ("colwise", "rowwise", "vocab")


def read_style(name, style, sequence_parallel, mod):
    """The Spec of plan entry ``name: style`` for module ``mod``; raises ValueError / TypeError naming
    the entry for anything unsupported."""
    if isinstance(style, str):
        spec = _read_string(name, style, sequence_parallel)
    else:
        spec = _read_torch(name, style, mod)
    _check_module_type(name, spec, mod)
    return spec


def _read_string(name, style, sequence_parallel):
    if style not in _STRINGS:
        raise ValueError(f"parallelize_module: plan value {style!r} for {name!r} is not one of {_STRINGS}")
    if style == "sequence":
        if not sequence_parallel:
            raise ValueError("parallelize_module: 'sequence' marks a module running on a sequence shard; pass "
                             "sequence_parallel=True (or drop it: without sequence parallelism LayerNorms stay "
                             "replicated and unmarked)")
        return Spec("sequence")
    layer = {"sequence_parallel": sequence_parallel}
    if style == "colwise":
        layer["gather_output"] = False
    elif style == "rowwise":
        layer["input_is_parallel"] = True
    return Spec(style, layer)


def _torch_types():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor import parallel as tp
    return Replicate, Shard, tp


def _read_torch(name, style, mod):
    Replicate, Shard, tp = _torch_types()
    kind = type(style).__name__
    if isinstance(style, tp.SequenceParallel):
        # use_local_output is accepted either way: our modules always see plain (local) tensors.
        if tuple(style.sequence_sharding) != (Shard(1),):
            raise ValueError(f"parallelize_module: {name!r}: SequenceParallel(sequence_dim="
                             f"{style.sequence_sharding[0].dim}) is not supported; use sequence_dim=1 "
                             f"(activations shaped batch x seq x hidden)")
        return Spec("sequence")
    prepare_types = tuple(getattr(tp, n) for n in ("PrepareModuleInput", "PrepareModuleOutput",
                                                   "PrepareModuleInputOutput") if hasattr(tp, n))
    if isinstance(style, prepare_types):
        return _read_prepare(name, style)
    if not isinstance(style, (tp.ColwiseParallel, tp.RowwiseParallel)):
        raise TypeError(f"parallelize_module: plan value {kind} for {name!r} is not supported; use 'colwise', "
                        f"'rowwise', 'vocab', 'sequence' or torch's ColwiseParallel, RowwiseParallel, "
                        f"SequenceParallel, PrepareModuleInput, PrepareModuleOutput")
    inp, out = style.input_layouts[0], style.output_layouts[0]
    dtensor_out = None if style.use_local_output else out
    if isinstance(style, tp.ColwiseParallel):
        if isinstance(mod, nn.Embedding):
            raise TypeError(f"parallelize_module: {name!r}: ColwiseParallel on an nn.Embedding (the embedding "
                            f"dim split) is not supported; use RowwiseParallel(input_layouts=Replicate()) or "
                            f"'vocab' (the vocabulary split)")
        if inp not in (Replicate(), Shard(1)) or out not in (Shard(-1), Replicate()):
            raise ValueError(f"parallelize_module: {name!r}: ColwiseParallel(input_layouts={inp!r}, output_layouts="
                             f"{out!r}) is not supported; inputs Replicate() or Shard(1), outputs Shard(-1) or "
                             f"Replicate()")
        return Spec("colwise", {"sequence_parallel": inp == Shard(1), "gather_output": out == Replicate()},
                    dtensor_out)
    if out not in (Replicate(), Shard(1)):
        raise ValueError(f"parallelize_module: {name!r}: RowwiseParallel(output_layouts={out!r}) is not supported; "
                         f"outputs Replicate() or Shard(1)")
    if isinstance(mod, nn.Embedding):
        if inp != Replicate():
            raise ValueError(f"parallelize_module: {name!r}: RowwiseParallel on an nn.Embedding needs "
                             f"input_layouts=Replicate() (the token ids on every rank); torch's default Shard(-1) "
                             f"would read each rank's ids as a slice of the sequence")
        return Spec("vocab", {"sequence_parallel": out == Shard(1)}, dtensor_out)
    if inp not in (Shard(-1), Replicate()):
        raise ValueError(f"parallelize_module: {name!r}: RowwiseParallel(input_layouts={inp!r}) is not supported; "
                         f"inputs Shard(-1) or Replicate()")
    return Spec("rowwise", {"sequence_parallel": out == Shard(1), "input_is_parallel": inp == Shard(-1)},
                dtensor_out)


def _pairs(name, what, src, dst):
    """[(from, to)] layout pairs of a PrepareModule* style, each one we can carry out."""
    Replicate, Shard, _ = _torch_types()
    if src is None:
        return None
    if dst is None or len(src) != len(dst):
        raise ValueError(f"parallelize_module: {name!r}: {what} layouts {src!r} and desired layouts {dst!r} differ in "
                         f"length")
    for a, b in zip(src, dst):
        ok = (a is None or b is None or a == b or (isinstance(a, Shard) and b == Replicate())
              or (a == Replicate() and isinstance(b, Shard)))
        if not ok:
            raise ValueError(f"parallelize_module: {name!r}: {what} layout {a!r} -> {b!r} is not supported; "
                             f"Shard(d) -> Replicate(), Replicate() -> Shard(d) or unchanged")
    return list(zip(src, dst))


def _read_prepare(name, style):
    pin = getattr(style, "prepare_module_input", None)
    pout = getattr(style, "prepare_module_output", None)
    if pin is None and pout is None:
        pin, pout = (style, None) if hasattr(style, "desired_input_layouts") else (None, style)
    spec = Spec("prepare")
    if pin is not None:
        spec.inputs = _pairs(name, "input", pin.input_layouts, pin.desired_input_layouts)
        kw_src, kw_dst = pin.input_kwarg_layouts, pin.desired_input_kwarg_layouts
        if set(kw_src) != set(kw_dst):
            raise ValueError(f"parallelize_module: {name!r}: input_kwarg_layouts {sorted(kw_src)} and "
                             f"desired_input_kwarg_layouts {sorted(kw_dst)} name different arguments")
        spec.kwarg_inputs = {k: _pairs(name, f"input {k!r}", (kw_src[k],), (kw_dst[k],))[0] for k in kw_src}
    if pout is not None:
        spec.outputs = _pairs(name, "output", pout.output_layouts, pout.desired_output_layouts)
    return spec


def _check_module_type(name, spec, mod):
    from .layers import check_embedding
    if spec.kind in ("sequence", "prepare"):
        return
    if isinstance(mod, nn.Embedding):
        if spec.kind == "colwise":
            raise TypeError(f"parallelize_module: {name!r} is an nn.Embedding; 'colwise' applies to nn.Linear "
                            f"(use 'vocab' or 'rowwise' to split its vocabulary)")
        check_embedding(mod, f"parallelize_module: {name!r}")
        spec.kind, spec.layer = "vocab", {"sequence_parallel": spec.layer.get("sequence_parallel", False)}
        return
    if not isinstance(mod, nn.Linear):
        raise TypeError(f"parallelize_module: {name!r} is a {type(mod).__name__}; {spec.kind!r} applies to "
                        f"nn.Linear{' or nn.Embedding' if spec.kind in ('vocab', 'rowwise') else ''}")


def redistribute(x, src, dst, group):
    """``x`` (a plain tensor in layout ``src``) in layout ``dst``; see the module docstring."""
    if src is None or dst is None or src == dst or not hasattr(x, "dim"):
        return x
    if hasattr(x, "to_local"):  # a DTensor from a layer with use_local_output=False
        x = x.to_local()
    if hasattr(dst, "dim"):  # Replicate() -> Shard(d)
        return split_seq(x, group, dst.dim)
    return gather_seq(x, group, src.dim, reduce_grad=False)


def _convert_all(what, name, values, pairs, group):
    values = values if isinstance(values, tuple) else (values,)
    if len(values) != len(pairs):
        raise ValueError(f"{name}: the module has {len(values)} {what}(s) but its PrepareModule{what.title()} "
                         f"names {len(pairs)} layout(s); give one per {what} (None to leave one alone)")
    return tuple(redistribute(v, a, b, group) for v, (a, b) in zip(values, pairs))


def apply_prepare(mod, name, spec, group):
    """Registers the hooks that carry out a PrepareModule* spec on ``mod``."""
    if spec.inputs is not None or spec.kwarg_inputs:
        def pre_hook(module, args, kwargs):
            if spec.inputs is not None:
                args = _convert_all("input", name, args, spec.inputs, group)
            kwargs = {k: redistribute(v, *spec.kwarg_inputs[k], group) if k in spec.kwarg_inputs else v
                      for k, v in kwargs.items()}
            return args, kwargs
        mod.register_forward_pre_hook(pre_hook, with_kwargs=True)
    if spec.outputs is not None:
        def hook(module, args, output):
            out = _convert_all("output", name, output, spec.outputs, group)
            return out[0] if len(out) == 1 else out
        mod.register_forward_hook(hook)
