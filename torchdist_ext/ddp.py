"""DistributedDataParallel with torchdist_ext's C++ bucketed reducer.

A drop-in for ``torch.nn.parallel.DistributedDataParallel``: same constructor signature and
defaults, same numerics (gradients pre-divided by the world size and summed in buckets), over any
c10d backend (tdx, gloo, nccl)::

    from torchdist_ext import DistributedDataParallel as DDP
    model = DDP(model)                      # instead of torch.nn.parallel.DistributedDataParallel

Implemented: bucketed asynchronous all_reduce overlapping backward (a small first bucket, then
``bucket_cap_mb``, rebuilt once from the observed gradient-ready order), ``no_sync()``,
``find_unused_parameters``, ``gradient_as_bucket_view``, ``static_graph`` (parameters whose
gradient accumulator runs several times, e.g. reentrant activation checkpointing), buffer
broadcast before forward, initial parameter broadcast after a shape check, ``join()`` for uneven
inputs (torch's ``Join``/``Joinable`` machinery), ``register_comm_hook`` (torch's Python hooks
unchanged, or the C++ built-ins of :mod:`torchdist_ext.comm_hooks`).
Not implemented (raise a clear error): multi-device modules.
"""
import inspect

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.utils._pytree import tree_flatten, tree_unflatten

from . import _C
from . import comm_hooks as _builtin_hooks
from ._grad_sync import suspended_grad_sync

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


class _StaticGraphSink(torch.autograd.Function):
    """Identity on forward's outputs whose backward (the first node of every backward) queues the
    reducer's end-of-backward callback on the outermost graph task, so that a reentrant backward
    (activation checkpointing) that happens to run the first gradient hook cannot end it early."""

    @staticmethod
    def forward(ctx, reducer, *tensors):
        ctx.reducer = reducer
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.reducer.queue_finalize()
        return (None, *grads)


class _DDPJoinHook(JoinHook):
    """Shadows, on a rank that ran out of inputs, the collectives of one DDP iteration of the
    others; at the end every rank takes the model of the last rank to join."""

    def __init__(self, ddp, divide_by_initial_world_size):
        self.ddp = ddp
        ddp._divide_by_initial_world_size = bool(divide_by_initial_world_size)

    def main_hook(self):
        ddp = self.ddp
        ddp._sync_buffers_for_forward(joined=True)
        flag = torch.zeros(1, device=ddp.join_device)
        dist.all_reduce(flag, group=ddp.process_group)
        # As torch's join hook: the next forward syncs buffers only after a synchronized backward.
        ddp.require_forward_param_sync = flag.item() != 0
        if ddp.require_forward_param_sync:  # some rank runs a synchronized backward this iteration
            ddp.reducer.join_shadow_backward()

    def post_hook(self, is_last_joiner):
        ddp = self.ddp
        ddp.reducer.set_divide_factor(0)  # back to the group size after join()
        src = ddp._find_common_rank(is_last_joiner)
        ddp._broadcast_from(list(p.data for p in ddp.module.parameters()) +
                            (list(ddp.module.buffers()) if ddp.broadcast_buffers else []), src)


class DistributedDataParallel(nn.Module, Joinable):
    """Data parallelism over a process group with a C++ bucketed reducer.

    Args:
        module: the module to replicate; every rank must pass a module with the same parameter
            shapes (checked), and rank 0's parameters and buffers are broadcast to the others.
        device_ids: as torch's DDP; for CPU modules leave it None. A single-device CUDA module
            may pass ``[device]``; more than one device is refused.
        output_device: as torch's DDP (unused for CPU modules).
        dim: the batch dimension (kept for signature compatibility; inputs are not scattered).
        broadcast_buffers: broadcast rank 0's buffers (e.g. BatchNorm statistics) before a forward, as torch's
            DDP: before the first one and after each forward followed by a synchronized backward.
        process_group: the group to reduce over; the default group when None.
        bucket_cap_mb: bucket size in MiB after the first (1 MiB) bucket.
        find_unused_parameters: search forward's outputs for parameters that get no gradient in
            an iteration and reduce zeros for them; without it such a parameter raises an error
            naming it.
        gradient_as_bucket_view: make each ``.grad`` a view into its bucket (saves a copy and
            memory; ``.grad`` must then not be replaced by the user).
        static_graph: the model uses the same parameters the same way in every iteration. Each
            parameter's gradient-hook count is recorded in the first iteration (whose buckets are
            all reduced at the end of backward), and later a parameter is reduced once its hook
            ran that often: supports parameters used twice under reentrant activation
            checkpointing (``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)``).
    """

    def __init__(self, module, device_ids=None, output_device=None, dim=0, broadcast_buffers=True,
                 process_group=None, bucket_cap_mb=25, find_unused_parameters=False,
                 gradient_as_bucket_view=False, static_graph=False):
        super().__init__()
        Joinable.__init__(self)
        if not dist.is_initialized():
            raise RuntimeError("DistributedDataParallel needs an initialized process group; call "
                               "torch.distributed.init_process_group(...) first")
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
        self.static_graph = bool(static_graph)
        self.require_backward_grad_sync = True
        # As torch's DDP: the buffers are broadcast before a forward only when the previous forward
        # was followed by a synchronized backward (grad enabled, outside no_sync()), or first.
        self.require_forward_param_sync = True
        self._divide_by_initial_world_size = True
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("DistributedDataParallel: the module has no parameter that requires grad")
        self._check_same_shapes(named)
        self._sync_module_states()
        self.reducer = _C.Reducer([p for _, p in named], [n for n, _ in named], self.process_group,
                                  _FIRST_BUCKET_BYTES, int(bucket_cap_mb * 1024 * 1024), find_unused_parameters,
                                  gradient_as_bucket_view, self.static_graph)

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

    def _broadcast_from(self, tensors, group_rank):
        src = (dist.get_global_rank(self.process_group, group_rank) if self.process_group is not dist.group.WORLD
               else group_rank)
        with torch.no_grad():
            for t in tensors:
                dist.broadcast(t, src=src, group=self.process_group)

    def _broadcast_from_rank0(self, tensors):
        self._broadcast_from(tensors, 0)

    def _find_common_rank(self, candidate):
        """The highest group rank among those passing candidate=True (an all_reduce MAX)."""
        me = dist.get_rank(self.process_group)
        t = torch.tensor([me if candidate else -1], device=self.join_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
        if t.item() < 0:
            raise RuntimeError("DistributedDataParallel.join: no rank offered itself as the source of the model")
        return int(t.item())

    def _sync_buffers_for_forward(self, joined):
        """Broadcasts the buffers before forward when torch's DDP does (``require_forward_param_sync``
        and ``broadcast_buffers``): from rank 0, or under join() from the highest rank that has not
        joined (a joined rank's buffers are stale)."""
        buffers = list(self.module.buffers())
        if not (self.require_forward_param_sync and self.broadcast_buffers and buffers
                and dist.get_world_size(self.process_group) > 1):
            return
        src = self._find_common_rank(not joined) if self._join_config.enable else 0
        self._broadcast_from(buffers, src)

    def _sync_module_states(self):
        self._broadcast_from_rank0([p.data for p in self.module.parameters()] +
                                   [b for b in self.module.buffers()])

    def forward(self, *inputs, **kwargs):
        grad_sync = torch.is_grad_enabled() and self.require_backward_grad_sync
        if self._join_config.enable:
            Join.notify_join_context(self)  # matches the all_reduce of the ranks that joined
        self._sync_buffers_for_forward(joined=False)
        training_ranks = None  # under join(): how many ranks run a synchronized backward now
        if self._join_config.enable:
            # Tells the joined ranks whether to shadow a backward this iteration.
            flag = torch.ones(1, device=self.join_device) if grad_sync else torch.zeros(1, device=self.join_device)
            dist.all_reduce(flag, group=self.process_group)
            training_ranks = int(flag.item())
            if not self._divide_by_initial_world_size and training_ranks > 0:
                # Average over the ranks that still train (the joined ones contribute zeros).
                self.reducer.set_divide_factor(training_ranks)
        if torch.is_grad_enabled() and training_ranks != 0:
            # As torch's DDP: the buckets are rebuilt in the first forward after the first
            # synchronized backward, under no_sync() too (a joined rank rebuilds in its shadow).
            self.reducer.rebuild_buckets()
        out = self.module(*inputs, **kwargs)
        self.require_forward_param_sync = grad_sync
        if grad_sync:
            self.reducer.prepare_for_backward(_outputs_as_tensors(out) if self.find_unused_parameters else [])
            if self.static_graph:
                out = self._static_graph_sink(out)
        return out

    def _static_graph_sink(self, out):
        flat, spec = tree_flatten(out)
        idx = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not idx:
            return out
        sunk = _StaticGraphSink.apply(self.reducer, *[flat[i] for i in idx])
        for i, t in zip(idx, sunk):
            flat[i] = t
        return tree_unflatten(flat, spec)

    def no_sync(self):
        """Backward passes inside accumulate gradients locally; the first one outside reduces."""
        return suspended_grad_sync(self)

    def register_comm_hook(self, state, hook):
        """Replaces each bucket's all_reduce by ``hook(state, bucket) -> torch.futures.Future[Tensor]``.

        As torch's ``DistributedDataParallel.register_comm_hook``: once, before the first forward;
        ``bucket`` is a ``torch.distributed.GradBucket`` holding the local gradients (not divided
        by the world size: the hook does it), and the future's tensor is the reduced bucket, copied
        into the gradients at the end of backward. Torch's hooks run unchanged
        (``torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook``,
        ``fp16_compress_hook``, ``bf16_compress_hook``, ``powerSGD_hook.powerSGD_hook``, ...).
        ``hook`` may also be a C++ built-in of :mod:`torchdist_ext.comm_hooks`
        (``fp16_compress``, ``bf16_compress``, ``int8_quantize``, ``topk_sparsify``, ``allreduce``),
        whose ``state`` is None or its options (``Int8State``, ``TopKState``).
        """
        if isinstance(hook, _builtin_hooks.BuiltinHook):
            self.reducer.register_builtin_comm_hook(self.process_group, hook.kind, **hook.options(state))
            return
        if not callable(hook):
            raise TypeError(f"register_comm_hook(state, hook): hook must be callable as hook(state, bucket), got "
                            f"{type(hook).__name__}")
        try:
            inspect.signature(hook).bind(state, None)
        except TypeError as e:
            raise TypeError(f"register_comm_hook: {getattr(hook, '__qualname__', hook)} cannot be called as "
                            f"hook(state, bucket): {e}") from None
        except ValueError:
            pass  # no signature to inspect (a builtin): let the call tell
        self.reducer.register_comm_hook(state, hook)

    def _register_builtin_comm_hook(self, comm_hook_type):
        """torch's ``dist.BuiltinCommHookType.ALLREDUCE`` / ``FP16_COMPRESS``, run by our C++ hooks."""
        kinds = {dist.BuiltinCommHookType.ALLREDUCE: "allreduce", dist.BuiltinCommHookType.FP16_COMPRESS: "fp16"}
        if comm_hook_type not in kinds:
            raise ValueError(f"_register_builtin_comm_hook: unknown {comm_hook_type!r}; expected one of "
                             f"{list(kinds)}")
        self.reducer.register_builtin_comm_hook(self.process_group, kinds[comm_hook_type])

    def join(self, divide_by_initial_world_size=True, enable=True, throw_on_early_termination=False):
        """Context manager for uneven inputs, as torch's ``DistributedDataParallel.join``.

        Inside it, a rank that runs out of batches keeps issuing, for every iteration of the
        others, the collectives of that iteration (buffer broadcast, one all_reduce per bucket with
        zero gradients, through the comm hook if one is registered). Gradients are divided by the
        initial world size, or with ``divide_by_initial_world_size=False`` by the number of ranks
        still training in that iteration (a comm hook divides by itself). On exit every rank takes the parameters (and buffers) of the last rank
        to join. ``throw_on_early_termination=True`` raises on every rank as soon as one runs out.
        """
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs):
        return _DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self):
        return next(self.module.parameters()).device

    @property
    def join_process_group(self):
        return self.process_group

    def bucket_indices(self):
        """Current bucket layout, as lists of indices into the trainable parameters."""
        return self.reducer.bucket_indices()
