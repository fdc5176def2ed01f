"""torchdist_ext: distributed training for PyTorch on the "tdx" c10d backend.

Importing the package registers the backend, so a script written for torch.distributed switches
by changing the backend string::

    import torch.distributed as dist
    import torchdist_ext  # registers "tdx"

    dist.init_process_group("tdx")            # CPU tensors through shared memory
    dist.init_process_group("cpu:tdx,cuda:nccl")  # CUDA tensors through NCCL
"""
from ._backend import BACKEND_NAME, is_registered, register
from .ddp import DistributedDataParallel
from . import comm_hooks  # DDP: built-in C++ communication hooks

__all__ = ["BACKEND_NAME", "DistributedDataParallel", "comm_hooks", "is_registered", "register"]

# --- ZeRO / FSDP (issue 5) ---
from .fsdp import (FullyShardedDataParallel, MixedPrecision, ModuleWrapPolicy,  # noqa: E402
                   full_state_dict, load_full_state_dict, load_sharded_checkpoint, save_sharded_checkpoint,
                   size_based_auto_wrap_policy)

__all__ += ["FullyShardedDataParallel", "MixedPrecision", "ModuleWrapPolicy", "full_state_dict",
            "load_full_state_dict", "load_sharded_checkpoint", "save_sharded_checkpoint", "size_based_auto_wrap_policy"]
# --- end ZeRO / FSDP ---

# CUDA work (issue 7): tdx's own kernels, torchdist_ext.kernels (pack/unpack, compression).
from . import kernels  # noqa: E402

__all__ += ["kernels"]

__version__ = "0.1.0"

# launch (issue 8): rank and rendezvous from torchrun's or srun's environment
from .launch import LaunchEnv, init_distributed, read_launch_env  # noqa: E402

__all__ += ["LaunchEnv", "init_distributed", "read_launch_env"]

# --- pipeline parallelism (issue 6): torchdist_ext.pipeline ---
from . import pipeline  # noqa: E402

__all__ += ["pipeline"]
# --- end pipeline ---

register()
