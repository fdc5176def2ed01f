"""Sharded data parallelism: ZeRO stages 1, 2, 3 (FSDP) over one sharding core.

See FullyShardedDataParallel for the API; checkpoints in checkpoint.py, state dicts in
state_dict.py, wrapping policies in wrap.py, mixed precision in mixed_precision.py.
"""
from .checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
from .clip_grad import clip_grad_norm_
from .fully_sharded import FullyShardedDataParallel
from .memory import training_state_bytes
from .mixed_precision import MixedPrecision
from .state_dict import full_state_dict, load_full_state_dict
from .wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

__all__ = ["FullyShardedDataParallel", "MixedPrecision", "ModuleWrapPolicy", "clip_grad_norm_", "full_state_dict",
           "load_full_state_dict", "load_sharded_checkpoint", "save_sharded_checkpoint", "size_based_auto_wrap_policy",
           "training_state_bytes"]
