"""Mixed precision for FullyShardedDataParallel: compute in a low-precision copy, keep fp32 masters."""
import dataclasses
from typing import Optional

import torch

__all__ = ["MixedPrecision"]


@dataclasses.dataclass(frozen=True)
class MixedPrecision:
    """Dtypes used around the fp32 master shards (torch's ``fsdp.MixedPrecision`` fields).

    A ``torch.distributed.fsdp.MixedPrecision`` instance is accepted as well.
    """

    param_dtype: Optional[torch.dtype] = None
    """Dtype of the all-gathered parameters forward and backward compute with (None: the
    parameters' own dtype). The optimizer still steps fp32 master shards."""
    reduce_dtype: Optional[torch.dtype] = None
    """Dtype gradients are reduced in (None: ``param_dtype``); the reduced shard is added to the
    master shard's gradient in the master dtype."""
    buffer_dtype: Optional[torch.dtype] = None
    """Dtype buffers (e.g. BatchNorm statistics) are cast to once at wrap time (None: unchanged)."""
    cast_forward_inputs: bool = True
    """Cast floating-point tensors among the root forward's inputs to ``param_dtype``."""


def resolve(mixed_precision):
    """Normalizes ``None``, our MixedPrecision or torch's into our MixedPrecision, with checks."""
    if mixed_precision is None:
        return MixedPrecision()
    fields = {}
    for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
        if not hasattr(mixed_precision, name):
            raise TypeError(f"FullyShardedDataParallel: mixed_precision must be a MixedPrecision (param_dtype, "
                            f"reduce_dtype, buffer_dtype), got {type(mixed_precision).__name__} without {name!r}")
        value = getattr(mixed_precision, name)
        if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
            raise ValueError(f"FullyShardedDataParallel: mixed_precision.{name}={value!r} must be a floating-point "
                             "torch.dtype or None")
        fields[name] = value
    fields["cast_forward_inputs"] = bool(getattr(mixed_precision, "cast_forward_inputs", True))
    return MixedPrecision(**fields)


def cast_inputs(obj, dtype):
    """Floating-point tensors inside (nested) args cast to ``dtype``; everything else unchanged."""
    if dtype is None:
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(cast_inputs(x, dtype) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast_inputs(x, dtype) for x in obj)
    if isinstance(obj, dict):
        return {k: cast_inputs(v, dtype) for k, v in obj.items()}
    return obj
