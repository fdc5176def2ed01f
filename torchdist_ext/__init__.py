"""torchdist_ext: distributed training for PyTorch on the "tdx" c10d backend.

Importing the package registers the backend, so a script written for torch.distributed switches
by changing the backend string::

    import torch.distributed as dist
    import torchdist_ext  # registers "tdx"

    dist.init_process_group("tdx")                # CPU tensors through shared memory
    dist.init_process_group("cpu:tdx,cuda:nccl")  # CUDA tensors through NCCL

What it holds:

- the backend: ``register``, ``is_registered``, ``BACKEND_NAME`` (its flight recorder:
  ``torchdist_ext.fr_trace``; its in-place operators ``torch.ops.tdx.*``, which
  ``torch.compile`` traces);
- data parallelism: ``DistributedDataParallel`` and its built-in ``comm_hooks``;
- sharded data parallelism (ZeRO 1/2/3): ``FullyShardedDataParallel`` and its policies and
  checkpoint functions;
- pipeline parallelism: the ``pipeline`` package;
- tensor parallelism: the ``tensor_parallel`` package and ``init_mesh`` (DP x PP x TP groups);
- launching: ``init_distributed``, ``read_launch_env``, ``LaunchEnv``;
- tdx's own kernels: ``kernels`` (compression on CUDA tensors);
- parameter servers (sync, async, bounded staleness; central storage): the ``ps`` package.
"""
import atexit as _atexit

from ._version import __version__

# the backend
from ._backend import BACKEND_NAME, is_registered, register
from . import _backend, _direct_ops, _failure_notice

# data parallelism
from . import comm_hooks
from .ddp import DistributedDataParallel

# sharded data parallelism (ZeRO stages 1/2/3)
from .fsdp import (FullyShardedDataParallel, MixedPrecision, ModuleWrapPolicy, full_state_dict,
                   load_full_state_dict, load_sharded_checkpoint, save_sharded_checkpoint,
                   size_based_auto_wrap_policy)

# pipeline parallelism
from . import pipeline

# tensor parallelism
from . import tensor_parallel
from .tensor_parallel import init_mesh

# launching
from .launch import LaunchEnv, PreemptionHandler, init_distributed, read_launch_env

# kernels
from . import kernels

# parameter servers (centralized and asynchronous training)
from . import ps

__all__ = [
    # the backend
    "BACKEND_NAME", "is_registered", "register",
    # data parallelism
    "DistributedDataParallel", "comm_hooks",
    # sharded data parallelism
    "FullyShardedDataParallel", "MixedPrecision", "ModuleWrapPolicy", "full_state_dict",
    "load_full_state_dict", "load_sharded_checkpoint", "save_sharded_checkpoint",
    "size_based_auto_wrap_policy",
    # pipeline parallelism
    "pipeline",
    # tensor parallelism
    "init_mesh", "tensor_parallel",
    # launching
    "LaunchEnv", "PreemptionHandler", "init_distributed", "read_launch_env",
    # kernels
    "kernels",
    # parameter servers
    "ps",
]

register()
_direct_ops.install()
_atexit.register(_backend.shut_down_live_groups)  # before the failure notice's hook, so it runs after it
_failure_notice.install()
