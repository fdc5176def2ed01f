"""DistributedDataParallel with torchdist_ext's C++ bucketed reducer.

A drop-in for ``torch.nn.parallel.DistributedDataParallel``: same constructor signature and
defaults, same numerics (gradients pre-divided by the world size and summed in buckets), over any
c10d backend (tdx, gloo, nccl)::

    from torchdist_ext import DistributedDataParallel as DDP
    model = DDP(model)                      # instead of torch.nn.parallel.DistributedDataParallel

Implemented: bucketed asynchronous all_reduce overlapping backward (a small first bucket, then
``bucket_cap_mb``, rebuilt once from the observed gradient-ready order), ``no_sync()``,
``find_unused_parameters``, ``gradient_as_bucket_view``, buffer broadcast before forward,
initial parameter broadcast after a shape check.
Not implemented yet (raise a clear error): ``static_graph=True``, ``register_comm_hook``,
``join()`` for uneven inputs, multi-device modules.
"""
import contextlib

import torch
import torch.distributed as dist
from torch import nn

from . import _C

__all__ = ["DistributedDataParallel"]

_FIRST_BUCKET_BYTES = 1024 * 1024  # as torch's DDP: a small first bucket starts communication early


def _outputs_as_tensors(out):
    """Every tensor in a (nested) forward output, for the unused-parameter search."""
    found = []

    def visit(x):
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                visit(y)
        elif isinstance(x, dict):
            for y in x.values():
                visit(y)

    visit(out)
    return found


class DistributedDataParallel(nn.Module):
    """Data parallelism over a process group with a C++ bucketed reducer.

    Args:
        module: the module to replicate; every rank must pass a module with the same parameter
            shapes (checked), and rank 0's parameters and buffers are broadcast to the others.
        device_ids: as torch's DDP; for CPU modules leave it None. A single-device CUDA module
            may pass ``[device]``; more than one device is refused.
        output_device: as torch's DDP (unused for CPU modules).
        dim: the batch dimension (kept for signature compatibility; inputs are not scattered).
        broadcast_buffers: broadcast rank 0's buffers (e.g. BatchNorm statistics) before each forward.
        process_group: the group to reduce over; the default group when None.
        bucket_cap_mb: bucket size in MiB after the first (1 MiB) bucket.
        find_unused_parameters: search forward's outputs for parameters that get no gradient in
            an iteration and reduce zeros for them; without it such a parameter raises an error
            naming it.
        gradient_as_bucket_view: make each ``.grad`` a view into its bucket (saves a copy and
            memory; ``.grad`` must then not be replaced by the user).
        static_graph: not implemented yet; must be False.
    """

    def __init__(self, module, device_ids=None, output_device=None, dim=0, broadcast_buffers=True,
                 process_group=None, bucket_cap_mb=25, find_unused_parameters=False,
                 gradient_as_bucket_view=False, static_graph=False):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("DistributedDataParallel needs an initialized process group; call "
                               "torch.distributed.init_process_group(...) first")
        if static_graph:
            raise NotImplementedError("torchdist_ext.DistributedDataParallel: static_graph=True is not implemented "
                                      "yet; use static_graph=False, or torch.nn.parallel.DistributedDataParallel")
        if device_ids is not None and len(device_ids) > 1:
            raise ValueError(f"device_ids={device_ids}: a module spread over several devices is not supported; pass "
                             "one device (or None for CPU modules)")
        if bucket_cap_mb is None:
            bucket_cap_mb = 25
        if bucket_cap_mb <= 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.module = module
        self.device_ids = device_ids
        self.output_device = output_device
        self.dim = dim
        self.broadcast_buffers = broadcast_buffers
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = False
        self.require_backward_grad_sync = True
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("DistributedDataParallel: the module has no parameter that requires grad")
        self._check_same_shapes(named)
        self._sync_module_states()
        self.reducer = _C.Reducer([p for _, p in named], [n for n, _ in named], self.process_group,
                                  _FIRST_BUCKET_BYTES, int(bucket_cap_mb * 1024 * 1024), find_unused_parameters,
                                  gradient_as_bucket_view)

    def _check_same_shapes(self, named):
        mine = [(n, tuple(p.shape), str(p.dtype)) for n, p in named]
        everyone = [None] * dist.get_world_size(self.process_group)
        dist.all_gather_object(everyone, mine, group=self.process_group)
        for rank, theirs in enumerate(everyone):
            if theirs != mine:
                diff = next(((a, b) for a, b in zip(mine, theirs) if a != b), None)
                detail = (f"first difference: this rank has {diff[0]}, rank {rank} has {diff[1]}" if diff
                          else f"this rank has {len(mine)} parameters, rank {rank} has {len(theirs)}")
                raise ValueError("DistributedDataParallel: ranks hold modules with different parameters (" + detail +
                                 "); every rank must build the same model before wrapping it")

    def _broadcast_from_rank0(self, tensors):
        src = dist.get_global_rank(self.process_group, 0) if self.process_group is not dist.group.WORLD else 0
        with torch.no_grad():
            for t in tensors:
                dist.broadcast(t, src=src, group=self.process_group)

    def _sync_module_states(self):
        self._broadcast_from_rank0([p.data for p in self.module.parameters()] +
                                   [b for b in self.module.buffers()])

    def forward(self, *inputs, **kwargs):
        if self.broadcast_buffers and torch.is_grad_enabled():
            buffers = list(self.module.buffers())
            if buffers and dist.get_world_size(self.process_group) > 1:
                self._broadcast_from_rank0(buffers)
        out = self.module(*inputs, **kwargs)
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self.reducer.prepare_for_backward(_outputs_as_tensors(out) if self.find_unused_parameters else [])
        return out

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes inside accumulate gradients locally; the first one outside reduces."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def register_comm_hook(self, state, hook):
        raise NotImplementedError("torchdist_ext.DistributedDataParallel.register_comm_hook is not implemented yet")

    def join(self, *args, **kwargs):
        raise NotImplementedError("torchdist_ext.DistributedDataParallel.join is not implemented yet; give every "
                                  "rank the same number of batches (e.g. DistributedSampler(drop_last=True))")

    def bucket_indices(self):
        """Current bucket layout, as lists of indices into the trainable parameters."""
        return self.reducer.bucket_indices()
