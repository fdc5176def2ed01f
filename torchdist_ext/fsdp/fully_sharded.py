"""FullyShardedDataParallel: ZeRO stages 1, 2 and 3 over one sharding core.

Orchestration only: which unit is gathered, prefetched, reduced and freed when. The flat
parameter mechanics live in flat_param.py, the stage switches in _stages.py, unit selection in
wrap.py.
"""
import torch
import torch.distributed as dist
from torch import nn

from .._grad_sync import suspended_grad_sync
from . import mixed_precision as _mp
from ._agreement import END_OF_BACKWARD, Agreement
from ._grad_norm import clip_shard_grads_
from ._stages import stage_policy
from .flat_param import FlatParamUnit
from .wrap import choose_units, collect_unit_params

__all__ = ["FullyShardedDataParallel"]

# Gradient reductions left in flight when the next unit launches its own; each holds a unit's full
# gradient. One, and it is finished when the next unit's backward starts (its pre-backward hook,
# before it prefetches the unit after it) or at the latest just before that unit's flat gradient
# is assembled (FlatParamUnit.before_flat_grad): two units' full gradients never coexist, nor a
# reduction's buffers with a prefetched unit and a new gradient (the stage-3 peak of backward).
_MAX_REDUCTIONS_IN_FLIGHT = 1


def _tensors_in(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for x in obj for t in _tensors_in(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in _tensors_in(x)]
    return []


def _offload_requested(cpu_offload):
    if isinstance(cpu_offload, bool):
        return cpu_offload
    if hasattr(cpu_offload, "offload_params"):  # torch.distributed.fsdp.CPUOffload
        return bool(cpu_offload.offload_params)
    raise TypeError(f"FullyShardedDataParallel: cpu_offload must be a bool (or torch's CPUOffload), got "
                    f"{type(cpu_offload).__name__}")


class FullyShardedDataParallel(nn.Module):
    """Sharded data parallelism (ZeRO stages 1, 2, 3) over any c10d backend.

    ``model.parameters()`` yields one fp32 master shard per wrapped unit (this rank's slice of the
    unit's flat parameter), so a plain ``torch.optim`` optimizer steps exactly what this rank owns::

        model = FullyShardedDataParallel(net, stage=3, auto_wrap_policy=ModuleWrapPolicy({Block}))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss = model(x).sum(); loss.backward(); opt.step(); opt.zero_grad()

    Args:
        module: the module to shard. Every rank builds the same module; rank 0's values win.
        stage: 1: optimizer state sharded (gradients all-reduced, each rank keeps and steps its
            shard, parameters all-gathered before the next forward); 2: gradients reduce-scattered
            to their shard as well; 3: parameters sharded at rest too, all-gathered just before each
            unit's forward and backward and freed after.
        process_group: the group to shard over (default: the default group). Its backend needs
            all_gather_into_tensor and reduce_scatter_tensor (tdx, gloo, nccl have them).
        auto_wrap_policy: which submodules become units of their own (ModuleWrapPolicy, a set of
            module classes, functools.partial(size_based_auto_wrap_policy, min_num_params=N), or
            torch's equivalents). The root module is always a unit holding the rest.
        mixed_precision: MixedPrecision(param_dtype, reduce_dtype, buffer_dtype) (ours or torch's).
        cpu_offload: for CUDA modules, keep shards, their gradients and hence the optimizer state
            in (pinned) CPU memory; the optimizer then steps on the CPU. For CPU modules it changes
            nothing (everything is already in CPU memory).
        forward_prefetch: start the all-gather of the next unit (in the order observed in the
            first forward) while the current one computes.
        backward_prefetch: in backward, start the all-gather of the unit that runs backward next.
    """

    def __init__(self, module, *, stage=3, process_group=None, auto_wrap_policy=None, mixed_precision=None,
                 cpu_offload=False, forward_prefetch=True, backward_prefetch=True):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"FullyShardedDataParallel: module must be an nn.Module, got {type(module).__name__}")
        if not dist.is_initialized():
            raise RuntimeError("FullyShardedDataParallel needs an initialized process group; call "
                               "torch.distributed.init_process_group(...) first")
        if any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
            raise ValueError("FullyShardedDataParallel: the module already contains a FullyShardedDataParallel; "
                             "wrap the plain module once and use auto_wrap_policy for nested units")
        self.policy = stage_policy(stage)
        self.stage = stage
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.mixed_precision = _mp.resolve(mixed_precision)
        self.forward_prefetch = bool(forward_prefetch)
        self.backward_prefetch = bool(backward_prefetch)
        self.module = module
        params = list(module.parameters())
        compute_device = params[0].device if params else torch.device("cpu")
        offload = _offload_requested(cpu_offload) and compute_device.type != "cpu"
        self.cpu_offload = offload
        shard_device = torch.device("cpu") if offload else compute_device

        # Original keys and buffer dtypes, for full_state_dict (before anything is changed).
        self._orig_keys = list(module.state_dict().keys())
        self._buffer_dtypes = {n: b.dtype for n, b in module.named_buffers()}
        unit_modules = choose_units(module, auto_wrap_policy)
        unit_params = collect_unit_params(module, unit_modules)
        self._check_same_model(unit_params)
        self._units = []
        for mod, up in zip(unit_modules, unit_params):
            if not up.params:
                continue  # a module without parameters of its own needs no flat parameter
            unit = FlatParamUnit(len(self._units), mod, up, group=self.process_group, policy=self.policy,
                                 mixed_precision=self.mixed_precision, compute_device=compute_device,
                                 shard_device=shard_device)
            self._units.append(unit)
        self._root_unit = self._units[-1] if self._units and self._units[-1].module is module else None
        # Units that run or get gradients on some ranks only raise a clear error (_agreement.py).
        self._agreement = Agreement(self.process_group, self._units, module, compute_device)
        for unit in self._units:
            unit.agreement = self._agreement
        self._sync_buffers()

        self.require_backward_grad_sync = True
        self._order = []          # units in the order their forward ran (recorded in the first forward)
        self._order_final = False
        self._in_backward = False
        self._reducing = []       # units whose gradient reduction is in flight, oldest first
        self._handles = []
        for unit in self._units:
            self._handles.append(unit.module.register_forward_pre_hook(self._make_pre_forward(unit)))
            self._handles.append(unit.module.register_forward_hook(self._make_post_forward(unit)))
            if unit.trainable:
                unit.full.register_post_accumulate_grad_hook(self._make_post_backward(unit))
                unit.before_flat_grad.append(self._finish_earlier_reductions)

    # ---- construction helpers -----------------------------------------------------------------
    def _check_same_model(self, unit_params):
        mine = [[(n[0], tuple(p.shape), str(p.dtype)) for p, n in zip(up.params, up.names)] for up in unit_params]
        everyone = [None] * dist.get_world_size(self.process_group)
        dist.all_gather_object(everyone, mine, group=self.process_group)
        for rank, theirs in enumerate(everyone):
            if theirs != mine:
                raise ValueError(f"FullyShardedDataParallel: rank {rank} wraps a different model than this rank "
                                 f"(units and parameters differ: {theirs} vs {mine}); every rank must build the same "
                                 "module and pass the same auto_wrap_policy")

    def _sync_buffers(self):
        bdtype = self.mixed_precision.buffer_dtype
        with torch.no_grad():
            for mod in self.module.modules():
                for name, buf in list(mod._buffers.items()):
                    if buf is None:
                        continue
                    if bdtype is not None and buf.is_floating_point():
                        buf = buf.to(bdtype)
                        mod._buffers[name] = buf
                    if dist.get_world_size(self.process_group) > 1:
                        dist.broadcast(buf, src=dist.get_global_rank(self.process_group, 0), group=self.process_group)

    # ---- forward --------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self._in_backward:
            self._in_backward = False  # a backward that never finished (e.g. an exception): start fresh
        mp = self.mixed_precision
        if mp.param_dtype is not None and mp.cast_forward_inputs:
            args, kwargs = _mp.cast_inputs(args, mp.param_dtype), _mp.cast_inputs(kwargs, mp.param_dtype)
        if not self.policy.shard_params_at_rest and self.forward_prefetch:
            for unit in (self._order if self._order_final else self._units):
                unit.start_unshard()  # stages 1-2: refresh every unit stepped since the last gather
        out = self.module(*args, **kwargs)
        self._order_final = True
        if not torch.is_grad_enabled() or not any(t.requires_grad for t in _tensors_in(out)):
            for unit in self._units:  # no backward will follow: stage 3 frees everything now
                unit.reshard(force=True)
        return out

    def _make_pre_forward(self, unit):
        def hook(module, args):
            if not self._order_final and unit not in self._order:
                self._order.append(unit)
            unit.wait_unshard()
            unit.use_views()
            if self.policy.shard_params_at_rest and self.forward_prefetch and self._order_final:
                nxt = self._neighbour(unit, +1)
                if nxt is not None:
                    nxt.start_unshard()
        return hook

    def _make_post_forward(self, unit):
        def hook(module, args, output):
            if unit is not self._root_unit:
                unit.reshard()
            if torch.is_grad_enabled():
                for t in _tensors_in(output):
                    if t.requires_grad:
                        t.register_hook(self._make_pre_backward(unit))
            return output
        return hook

    def _neighbour(self, unit, step):
        try:
            i = self._order.index(unit) + step
        except ValueError:
            return None
        return self._order[i] if 0 <= i < len(self._order) else None

    # ---- backward -------------------------------------------------------------------------------
    def _start_backward(self):
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _make_pre_backward(self, unit):
        def hook(grad):
            self._start_backward()
            unit.wait_unshard()
            if self.policy.shard_params_at_rest and self.backward_prefetch:
                prev = self._neighbour(unit, -1)
                if prev is not None:
                    # The previous unit's reduction first: its full gradient must not coexist with
                    # this unit's parameters, the prefetched ones and this unit's gradients.
                    self._finish_earlier_reductions(unit)
                    prev.start_unshard()
            return grad
        return hook

    def _make_post_backward(self, unit):
        def hook(full):
            self._start_backward()
            if self.require_backward_grad_sync:
                unit.start_reduce()  # as soon as this unit's gradient is complete
                self._reducing.append(unit)
                # Bound memory: the oldest reduction (launched a unit earlier, usually done by now)
                # is finished so its full gradient is freed, as torch's FSDP does.
                while len(self._reducing) > _MAX_REDUCTIONS_IN_FLIGHT:
                    self._reducing.pop(0).finish_reduce()
            unit.reshard()
        return hook

    def _finish_earlier_reductions(self, unit):
        # Finishes the reductions launched by units that finished backward before `unit`, freeing
        # their full gradients before `unit` prefetches another unit or allocates its own flat
        # gradient (the peak-memory moments of backward).
        while self._reducing and self._reducing[0] is not unit:
            self._reducing.pop(0).finish_reduce()

    def _finish_backward(self):
        self._in_backward = False
        if self.require_backward_grad_sync:
            self._agreement.check(END_OF_BACKWARD)  # no rank has a unit left to reduce
        self._reducing.clear()
        for unit in self._units:
            unit.finish_reduce()
        for unit in self._units:
            unit.reshard(force=True)

    def no_sync(self):
        """Backward passes inside accumulate full gradients locally without communication; the
        first backward outside reduces the accumulated sum (as torch's FSDP/DDP ``no_sync``)."""
        return suspended_grad_sync(self)

    # ---- utilities ------------------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm, norm_type=2.0):
        """Clips the shards' gradients by the global norm over all ranks; returns that norm."""
        return clip_shard_grads_(self._units, self.process_group, max_norm, norm_type)

    def release(self, flats):
        """Gives the wrapped module back with plain parameters holding ``flats`` (one whole flat
        buffer per unit, in ``units`` order): hooks removed, original parameters and attributes
        restored, so it can be wrapped again (e.g. over a shrunk group). This wrapper is unusable
        after; returns the module."""
        if len(flats) != len(self._units):
            raise ValueError(f"FullyShardedDataParallel.release: got {len(flats)} flat buffers for "
                             f"{len(self._units)} units; pass one whole flat buffer per unit, in `units` order")
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._reducing.clear()
        for unit, flat in zip(self._units, flats):
            unit.release(flat)
        return self.module

    @property
    def units(self):
        """The FlatParamUnit of each wrapped unit (root last)."""
        return list(self._units)

    def extra_repr(self):
        return f"stage={self.stage}, units={len(self._units)}, world_size={dist.get_world_size(self.process_group)}"
