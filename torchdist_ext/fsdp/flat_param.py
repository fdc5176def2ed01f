"""One wrapped unit's flat parameter: the fp32 master shard the optimizer steps, the full
(all-gathered) buffer forward and backward compute with, and the gradient reduction.

The layout and shard math come from the C++ sharding core (``_C.FlatLayout``); this file only moves
tensors according to it. The stage policy decides whether gradients are all-reduced (stage 1) or
reduce-scattered (2, 3) and whether the full buffer is freed between uses (3).
"""
import torch
import torch.distributed as dist
from torch import nn

from .. import _C
from ._agreement import GATHER, REDUCE

ALIGNMENT = 4  # elements; parameters and shards start at multiples of it (16 bytes in fp32)


def _all_gather_into(out, inp, group):
    # torch >= 2.13 names it all_gather_single (all_gather_into_tensor warns); older ones lack it.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=True)


def _reduce_scatter_into(out, inp, group):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, op=dist.ReduceOp.SUM, group=group, async_op=True)


class FlatParamUnit:
    """The sharded state of one unit.

    Attributes: ``shard`` (nn.Parameter, this rank's slice of the flat buffer in the parameters'
    own dtype, on ``shard_device``), ``full`` (leaf tensor of the whole padded buffer in the compute
    dtype; its storage is empty while resharded), ``layout`` (``_C.FlatLayout``).
    """

    def __init__(self, index, module, unit_params, *, group, policy, mixed_precision, compute_device,
                 shard_device):
        self.index = index
        self.module = module
        self.group = group
        self.policy = policy
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.params_meta = unit_params
        self.shapes = [tuple(p.shape) for p in unit_params.params]
        self.names = unit_params.names
        self.holders = unit_params.holders
        self.layout = _C.FlatLayout([p.numel() for p in unit_params.params], ALIGNMENT, self.world_size)
        first = unit_params.params[0]
        self.dtype = first.dtype
        self.trainable = first.requires_grad
        self.compute_device = compute_device
        self.shard_device = shard_device
        self.compute_dtype = mixed_precision.param_dtype or self.dtype
        self.reduce_dtype = mixed_precision.reduce_dtype or self.compute_dtype
        begin, end = self.layout.shard_range(self.rank)

        source = self.layout.flatten([p.detach() for p in unit_params.params], self.dtype, compute_device)
        if self.world_size > 1:  # every rank starts from rank 0's values
            dist.broadcast(source, src=dist.get_global_rank(group, 0), group=group)
        # Stages 1-2 without casting or offload: the shard is a view of the full buffer, so the
        # parameters are stored once and the optimizer's update lands in place.
        self.aliased = (not policy.shard_params_at_rest and self.compute_dtype == self.dtype
                        and shard_device == compute_device)
        with torch.no_grad():
            if self.aliased:
                self.full = source.requires_grad_(self.trainable)
                self.shard = nn.Parameter(source.detach()[begin:end], requires_grad=self.trainable)
            else:
                self.shard = nn.Parameter(source[begin:end].to(shard_device, copy=True), requires_grad=self.trainable)
                if shard_device.type == "cpu" and compute_device.type == "cuda":
                    self.shard.data = self.shard.data.pin_memory()
                del source
                self.full = torch.empty(self.layout.padded_numel, dtype=self.compute_dtype,
                                        device=compute_device).requires_grad_(self.trainable)
        self._full_nbytes = self.full.untyped_storage().nbytes()
        self._gathered_version = self.shard._version if self.aliased else None
        self._gather = None   # (work, input) of an all-gather in flight
        self._reduce = None   # (work, reduced tensor) of a gradient reduction in flight
        # Called just before autograd assembles this unit's flat gradient (see use_views); the
        # owner uses it to finish the previous unit's reduction first.
        self.before_flat_grad = []
        # Set by the owner: checks that every rank issues the same collective next (_agreement.py).
        self.agreement = None
        if not self.aliased and policy.shard_params_at_rest:
            self._free_full()
        # Each holder module's parameter order, so release() can put the originals back in place.
        self._param_order = {id(mod): list(mod._parameters) for hs in self.holders for mod, _ in hs}
        for p in unit_params.params:  # the originals are replaced by views of `full` in forward
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        for holders in self.holders:
            for mod, attr in holders:
                del mod._parameters[attr]
        module.register_parameter("_fsdp_flat_shard", self.shard)

    # ---- parameters -------------------------------------------------------------------------
    def _allocated(self):
        return self.full.untyped_storage().nbytes() > 0

    def _free_full(self):
        self.full.untyped_storage().resize_(0)

    def is_current(self):
        """True when ``full`` holds the shards' present values (no gather needed)."""
        return self._allocated() and self._gathered_version == self.shard._version and self._gather is None

    def invalidate(self):
        """The shards were changed in place (e.g. a loaded state dict) on some ranks: the next use
        gathers on every rank, whatever each rank's shard version says."""
        self.settle()
        self._gathered_version = None

    def start_unshard(self):
        """Starts an asynchronous all-gather of the shards into ``full`` (no-op when current)."""
        if self._gather is not None or self.is_current():
            return
        if self.agreement is not None:
            self.agreement.check(GATHER, self.index)
        if not self._allocated():
            self.full.untyped_storage().resize_(self._full_nbytes)
        with torch.no_grad():
            src = self.shard.detach()
            if src.dtype != self.compute_dtype or src.device != self.compute_device:
                src = src.to(device=self.compute_device, dtype=self.compute_dtype, non_blocking=True)
            elif self.aliased:
                src = src.clone()  # the input must not alias the output's slice
        work = _all_gather_into(self.full.data, src, self.group)
        self._gather = (work, src, self.shard._version)

    def wait_unshard(self):
        """Waits for (or starts and waits for) the all-gather; ``full`` is then current."""
        self.start_unshard()
        if self._gather is not None:
            work, _, version = self._gather
            work.wait()
            self._gather = None
            self._gathered_version = version

    def settle(self):
        """Waits for an all-gather still in flight (e.g. a prefetch of a unit that never ran)."""
        if self._gather is not None:
            self.wait_unshard()

    def reshard(self, force=False):
        """Frees the full buffer (stage 3 only; stages 1-2 keep it). ``force`` first waits for a
        gather in flight; otherwise a unit whose gather is in flight stays as it is."""
        if force:
            self.settle()
        if self.policy.shard_params_at_rest and self._gather is None and self._allocated():
            self._free_full()
            self._gathered_version = None

    def use_views(self):
        """Points every original parameter attribute at its view of ``full``.

        A pre-hook on the views' split node (it runs once every gradient of the unit's parameters
        exists, just before autograd assembles the unit's flat gradient) calls the callbacks in
        ``before_flat_grad`` and, in stage 3, frees the full parameters, so neither the gathered
        parameters nor the previous unit's reduction buffers coexist with the new flat gradient.
        """
        views = self.layout.views(self.full, [list(s) for s in self.shapes])
        for view, holders in zip(views, self.holders):
            for mod, attr in holders:
                setattr(mod, attr, view)
        if views and views[0].grad_fn is not None:
            node = views[0].grad_fn
            if "Split" not in node.name():
                node = node.next_functions[0][0]
            if node is not None and "Split" in node.name():
                node.register_prehook(self._before_flat_grad)

    def _before_flat_grad(self, grad_outputs):
        for callback in self.before_flat_grad:
            callback(self)
        self.reshard()

    # ---- gradients ---------------------------------------------------------------------------
    def start_reduce(self):
        """Launches this unit's gradient reduction (a sum; divided by the world size on the shard)."""
        grad = self.full.grad
        self.full.grad = None
        if grad is None:
            return
        if self.agreement is not None:
            self.agreement.check(REDUCE, self.index)
        with torch.no_grad():
            grad = grad.to(self.reduce_dtype) if grad.dtype != self.reduce_dtype else grad
            if self.policy.reduce_scatter_grads:
                out = torch.empty(self.layout.shard_numel, dtype=grad.dtype, device=grad.device)
                work = _reduce_scatter_into(out, grad, self.group)
                self._reduce = (work, out, grad)
            else:
                work = dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
                begin, end = self.layout.shard_range(self.rank)
                self._reduce = (work, grad[begin:end], grad)

    def finish_reduce(self):
        """Waits for the reduction and accumulates the mean into ``shard.grad``."""
        if self._reduce is None:
            return
        work, reduced, full_grad = self._reduce
        self._reduce = None
        work.wait()
        with torch.no_grad():
            # Dividing the 1/N shard instead of the whole gradient: N times less work.
            own = reduced._base is None and reduced.dtype == self.shard.dtype and reduced.device == self.shard_device
            if self.shard.grad is None:
                if own:
                    self.shard.grad = reduced.div_(self.world_size) if self.world_size > 1 else reduced
                else:
                    self.shard.grad = reduced.to(device=self.shard_device, dtype=self.shard.dtype, copy=True)
                    if self.world_size > 1:
                        self.shard.grad.div_(self.world_size)
            elif self.world_size > 1:
                self.shard.grad.add_(reduced.to(device=self.shard_device, dtype=self.shard.dtype),
                                     alpha=1.0 / self.world_size)
            else:
                self.shard.grad.add_(reduced.to(device=self.shard_device, dtype=self.shard.dtype))
        del full_grad

    def release(self, flat):
        """Undoes the wrapping of this unit: the original parameters get back their attributes, in
        their modules' original order, holding copies of their slices of ``flat`` (a whole flat
        buffer of this layout, unpadded part used), and the flat shard is unregistered. Used to
        re-wrap the module over another group (elastic recovery); this unit is unusable after."""
        self._gather = self._reduce = None  # in flight on a group that failed: never waited for
        del self.module._parameters["_fsdp_flat_shard"]
        for p, (_, tensor) in zip(self.params_meta.params, self.full_params_from(flat)):
            p.data = tensor.detach().to(device=p.device, dtype=p.dtype, copy=True)
        restored = {}  # id(module) -> (module, {attribute: parameter})
        for p, holders in zip(self.params_meta.params, self.holders):
            for mod, attr in holders:
                mod.__dict__.pop(attr, None)  # the view use_views() set
                restored.setdefault(id(mod), (mod, {}))[1][attr] = p
        for key, (mod, params) in restored.items():
            current = {**mod._parameters, **params}
            mod._parameters.clear()
            for attr in self._param_order[key]:
                if attr in current:
                    mod._parameters[attr] = current.pop(attr)
            mod._parameters.update(current)
        self._free_full()

    # ---- checkpoints and state dicts -----------------------------------------------------------
    def describe(self):
        """Plain-data description of the layout, for manifests and mismatch checks."""
        return {"names": [n[0] for n in self.names], "shapes": [list(s) for s in self.shapes],
                "numels": list(self.layout.numels), "alignment": self.layout.alignment,
                "dtype": str(self.dtype).replace("torch.", "")}

    def full_params_from(self, flat):
        """(names, tensor) for every parameter of a gathered flat buffer (unpadded part used)."""
        out = []
        for off, numel, shape, names in zip(self.layout.offsets, self.layout.numels, self.shapes, self.names):
            out.append((names, flat[off:off + numel].view(shape)))
        return out
