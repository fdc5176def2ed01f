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

# CUDA work (issue 7): tdx's own kernels, torchdist_ext.kernels (pack/unpack, compression).
from . import kernels  # noqa: E402

__all__ = ["BACKEND_NAME", "DistributedDataParallel", "is_registered", "register"]
__version__ = "0.1.0"

register()
