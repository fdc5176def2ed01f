"""PipelineStage: one stage's module, its place in the pipeline, and its per-micro-batch state.

Mirrors ``torch.distributed.pipelining.PipelineStage``; the schedules in ``schedules.py`` drive it.
"""
import contextlib

import torch
import torch.distributed as dist
from torch import nn

from ._backward import ParamNodes, backward_input
from ._meta import describe, meta_of
from ._values import OBJECT, Packet, float_leaves, needs_packet, tensor_leaves
from ._wgrad import WeightGradBatcher, planned

__all__ = ["PipelineStage"]


def _as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _ddp_kind(module):
    """'ours', 'torch' or None: DDP-wrapped stages reduce gradients once per step, after the last backward."""
    from ..ddp import DistributedDataParallel as Ours

    if isinstance(module, Ours):
        return "ours"
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return "torch"
    return None


def _is_fsdp(module):
    """A module sharded by our FSDP or torch's (FSDP1 or fully_shard): it owns its gradients' reduction."""
    from ..fsdp import FullyShardedDataParallel as Ours

    kinds = [Ours]
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
        kinds.append(TorchFSDP)
        from torch.distributed.fsdp import FSDPModule
        kinds.append(FSDPModule)
    except ImportError:
        pass
    return isinstance(module, tuple(kinds))


def _declared(example):
    """Meta of an example input or output: shapes of a tuple of tensors, OBJECT for anything else."""
    if example is None:
        return None
    outs = _as_tuple(example)
    return OBJECT if needs_packet(outs) else meta_of(outs)


class PipelineStage:
    """One pipeline stage: a module, its index among ``num_stages``, and the process group it talks on.

    Args:
        submodule: the part of the model this stage runs. It may be wrapped in
            ``torchdist_ext.DistributedDataParallel`` (or torch's) over a data-parallel group to
            compose pipeline and data parallelism: gradients are then all-reduced across the
            replicas once per step, during the stage's last backward.
        stage_index: this stage's position, 0 to ``num_stages - 1``. Stage ``s`` must run on group
            rank ``s % group size`` (one stage per rank, or several looped stages per rank for
            the interleaved schedules), or in a V for ``ScheduleZBVZeroBubble`` and
            ``ScheduleDualPipeV`` (rank r holds stages r and 2 x group size - 1 - r).
        num_stages: the number of stages of the whole pipeline (all ranks must agree; checked at
            the first step).
        device: the device the stage computes on (received tensors are allocated there).
        input_args: optional example input (tensor or tuple) of one micro-batch. When given, the
            stage knows its input shapes and the previous stage sends no shape message; otherwise
            shapes come from the first micro-batch of a step (sent when they differ from the
            previous step's). Values that are more than a
            tuple of tensors (dicts, nested containers, Python values) travel with their
            structure per micro-batch; an example of them just says so.
        output_args: optional example output of one micro-batch; when given, outputs are checked
            against it.
        output_grads, input_grads: accepted for torch's signature (example gradients); unused, since
            gradient shapes are the shapes of the tensors they belong to.
        group: the pipeline's process group (the default group when None).
        dw_builder: torch's hook for a custom weight-gradient function; not implemented (must be None):
            zero-bubble schedules split any module's backward by themselves (``I`` and ``W`` actions).
        batch_weight_grads: (torchdist_ext only) compute the weight and bias gradients of the
            stage's ``nn.Linear`` layers for several micro-batches in one product (every
            ``max(2, num_stages)`` backwards and at the step's last one) instead of one per
            micro-batch; input gradients are computed at once as usual. None (the default): the
            layers whose weight has at least 512 x 512 elements, where batching pays (the decision
            room's rule, ``csrc/tuning/pipeline.h``; below it keeping each micro-batch's tensors
            costs more than the product saves); True: every linear layer; False: none. Gradients agree with
            autograd's within floating-point rounding; the stage keeps each deferred layer's input
            and output gradient until the product (``peak_pending_weight_grad_bytes`` says how
            much). Off for stages with DDP or FSDP anywhere inside (they reduce gradients as they
            arrive), and for
            layers that must see their gradients during backward (see
            ``torchdist_ext/pipeline/_wgrad.py``: gradient hooks on the tensors, autocast,
            checkpointing, mixed dtypes, parametrized weights; hooks on a weight's gradient
            accumulator are not detected: pass False then). The module is modified only while a
            training forward runs (its ``nn.Linear`` instances carry our forward). Off for the
            steps of a schedule with ``I``/``W`` actions (zero-bubble), which defer weight
            gradients themselves.
    """

    def __init__(self, submodule, stage_index, num_stages, device, input_args=None, output_args=None,
                 output_grads=None, input_grads=None, group=None, dw_builder=None, *, batch_weight_grads=None):
        if dw_builder is not None:
            raise NotImplementedError("PipelineStage: dw_builder (a custom weight-gradient function) is not "
                                      "implemented; leave it None: zero-bubble schedules split any module's backward "
                                      "into input and weight gradients by themselves")
        if not isinstance(submodule, nn.Module):
            raise TypeError(f"PipelineStage: submodule must be an nn.Module, got {type(submodule).__name__}")
        if not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"PipelineStage: num_stages must be a positive int, got {num_stages!r}")
        if not isinstance(stage_index, int) or not 0 <= stage_index < num_stages:
            raise ValueError(f"PipelineStage: stage_index must be in 0..{num_stages - 1} (num_stages={num_stages}), "
                             f"got {stage_index!r}")
        if batch_weight_grads not in (None, True, False):
            raise ValueError(f"PipelineStage: batch_weight_grads must be None (the layers where batching pays), True "
                             f"(every linear layer) or False (none), got {batch_weight_grads!r}")
        if not dist.is_initialized():
            raise RuntimeError("PipelineStage needs an initialized process group; call "
                               "torch.distributed.init_process_group(...) first")
        self.submod = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = torch.device(device)
        self.group = group if group is not None else dist.group.WORLD
        self.group_rank = dist.get_rank(self.group)
        if self.group_rank < 0:
            raise ValueError(f"PipelineStage: rank {dist.get_rank()} is not a member of the group passed as group=; "
                             "pass the pipeline group this rank belongs to")
        self.group_size = dist.get_world_size(self.group)
        self.input_meta = _declared(input_args)
        self.output_meta = _declared(output_args)
        self._ddp = _ddp_kind(submodule)
        wrapped = any(_ddp_kind(m) or _is_fsdp(m) for m in submodule.modules())
        self.wraps_reducer = wrapped  # DDP or FSDP inside: gradients are reduced as they arrive
        self._wgrad = None
        if batch_weight_grads is not False and not wrapped:
            batcher = WeightGradBatcher(submodule, planned if batch_weight_grads is None else None)
            self._wgrad = batcher if batcher.layers else None
        self._wgrad_every = max(2, num_stages)
        self._param_nodes = ParamNodes()
        self.peak_pending_weight_grad_bytes = 0  # the most bytes kept for deferred weight gradients
        self.clear_runtime_states()

    @property
    def is_first(self):
        return self.stage_index == 0

    @property
    def is_last(self):
        return self.stage_index == self.num_stages - 1

    def __repr__(self):
        return (f"PipelineStage(stage_index={self.stage_index}, num_stages={self.num_stages}, device={self.device}, "
                f"group rank {self.group_rank}/{self.group_size})")

    def clear_runtime_states(self, n_microbatches=None, split_backward=False):
        """Forgets the previous step's micro-batch state (called at the start of every step).

        ``n_microbatches``: the step's micro-batch count; with one there is nothing to batch, so
        weight gradients are not deferred. ``split_backward``: the step's schedule has ``I``/``W``
        actions (its own deferral of weight gradients; batch_weight_grads is then off for the step:
        autograd's split costs less CPU than our batched layers' kept pairs, see ``_wgrad.py``).
        """
        self._wgrad_on = (n_microbatches is None or n_microbatches > 1) and not split_backward
        self._pending_weights = {}  # microbatch -> what its I kept for its W
        self._cache = {}            # microbatch -> (inputs, outputs) kept for backward
        self._input_grads = {}      # microbatch -> gradients of the inputs, waiting to be sent
        self._step_out_meta = None  # output shapes of the first micro-batch of this step
        self.output_chunks = []     # last stage: outputs per micro-batch (detached)
        self._backwards_done = 0
        self._wgrad_due = False
        if self._wgrad:
            self._wgrad.clear()  # a failed step's deferred gradients are dropped with it

    # --- compute -----------------------------------------------------------------------------

    def _no_sync(self):
        return self.submod.no_sync() if self._ddp else contextlib.nullcontext()

    def forward_one(self, mb, args, kwargs, with_backward):
        """Runs micro-batch ``mb`` through the module; keeps what backward needs; returns the outputs
        (the last stage's as the module returned them; another stage's as a tuple of tensors, or a
        :class:`~torchdist_ext.pipeline._values.Packet` when they are more than that)."""
        if not self.is_first and with_backward:
            for t in float_leaves(args):
                t.requires_grad_(True)
        with self._no_sync():
            if self._wgrad and with_backward and self._wgrad_on:
                with self._wgrad.capture():
                    out = self.submod(*args, **kwargs)
            else:
                out = self.submod(*args, **kwargs)
        outs = _as_tuple(out)
        sent = outs
        if not self.is_last:
            if needs_packet(outs):
                sent = Packet(outs)
                if self.output_meta is not None and self.output_meta != OBJECT:
                    raise ValueError(f"stage {self.stage_index}: micro-batch {mb} produced more than tensors "
                                     f"({[type(o).__name__ for o in outs]}) but output_args declared "
                                     f"{describe(self.output_meta)}")
                self._step_out_meta = OBJECT
            else:
                self._check_output_shapes(mb, meta_of(outs))
        if with_backward:
            self._cache[mb] = (args if self.is_first else float_leaves(args), tensor_leaves(outs))
        return out if self.is_last else sent

    def _check_output_shapes(self, mb, meta):
        if self.output_meta is not None and meta != self.output_meta:
            raise ValueError(f"stage {self.stage_index}: micro-batch {mb} produced outputs {describe(meta)} but "
                             f"output_args declared {describe(self.output_meta)}")
        if self._step_out_meta is None:
            self._step_out_meta = meta
        elif meta != self._step_out_meta:
            raise ValueError(f"stage {self.stage_index}: the output shape changed between micro-batches: "
                             f"micro-batch {mb} produced {describe(meta)} but the first micro-batch of this step "
                             f"produced {describe(self._step_out_meta)}; every micro-batch must produce the same "
                             "shapes (equal micro-batch sizes, no data-dependent output shapes)")

    def flush_weight_grads(self, force=False):
        """Computes the deferred weight gradients (batch_weight_grads) when due, or all with ``force``.

        The schedules call it before each compute action, so a backward's input gradients are sent
        before the weight-gradient product that follows it, and with ``force`` at the end of a step.
        """
        if not (self._wgrad and (force or self._wgrad_due)):
            return
        # what is kept only grows until a flush, so its peak is what is there now
        self.peak_pending_weight_grad_bytes = max(self.peak_pending_weight_grad_bytes, self._wgrad.pending_bytes())
        self._wgrad.flush()
        self._wgrad_due = False

    def backward_one(self, mb, grad_outputs=None, loss=None, last_backward=False):
        """Backward of micro-batch ``mb`` from ``loss`` (last stage) or from the gradients of its outputs.

        ``last_backward``: this is the step's last backward of this stage; a DDP-wrapped module
        all-reduces its gradients during it.
        """
        args, outs = self._cache.pop(mb)
        tensors, grads = self._backward_roots(mb, outs, grad_outputs, loss)
        if last_backward and self._ddp:
            self._prepare_ddp(outs)
            ctx = contextlib.nullcontext()
        else:
            ctx = self._no_sync()
        with ctx:
            if tensors:
                torch.autograd.backward(tensors, grads)
        self._backwards_done += 1
        if self._wgrad and self._wgrad_on:
            # not now: the input gradients go to the previous stage first (see flush_weight_grads)
            self._wgrad_due = self._backwards_done % self._wgrad_every == 0
        if not self.is_first:
            self._input_grads[mb] = [a.grad if a.grad is not None else torch.zeros_like(a) for a in args
                                     if isinstance(a, torch.Tensor) and a.is_floating_point()]

    def _backward_roots(self, mb, outs, grad_outputs, loss):
        if loss is not None:
            return [loss], [None]
        floats = [o for o in outs if o.is_floating_point()]
        if len(floats) != len(grad_outputs):
            raise RuntimeError(f"stage {self.stage_index}: received {len(grad_outputs)} output gradients for "
                               f"micro-batch {mb}, expected {len(floats)}")
        pairs = [(o, g) for o, g in zip(floats, grad_outputs) if o.requires_grad]
        return [p[0] for p in pairs], [p[1] for p in pairs]

    def backward_input(self, mb, grad_outputs=None, loss=None):
        """The ``I`` action: the gradient of micro-batch ``mb``'s input only (to send to the previous
        stage); what the weight gradients need is kept for :meth:`backward_weight`."""
        args, outs = self._cache.pop(mb)
        tensors, grads = self._backward_roots(mb, outs, grad_outputs, loss)
        inputs = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
        params = [p for p in self.submod.parameters() if p.requires_grad]
        input_grads, self._pending_weights[mb] = backward_input(tensors, grads, inputs, params, self._param_nodes)
        self._backwards_done += 1
        if not self.is_first:
            self._input_grads[mb] = [g if g is not None else torch.zeros_like(a) for a, g in zip(inputs, input_grads)]

    def backward_weight(self, mb):
        """The ``W`` action: adds micro-batch ``mb``'s parameter gradients into ``.grad``."""
        if mb not in self._pending_weights:
            raise RuntimeError(f"stage {self.stage_index}: W of micro-batch {mb} runs before its I")
        self._pending_weights.pop(mb).run()

    def _prepare_ddp(self, outs):
        reducer = self.submod.reducer
        if self._ddp == "ours":
            reducer.prepare_for_backward(list(outs) if self.submod.find_unused_parameters else [])
        else:
            reducer.prepare_for_backward(list(torch.nn.parallel.distributed._find_tensors(outs)))

    def pop_input_grads(self, mb):
        return self._input_grads.pop(mb)

    def saved_outputs(self, mb):
        return self._cache[mb][1]

    def step_output_meta(self):
        """Output shapes of this step (from its first micro-batch), or the declared ones, or None."""
        return self._step_out_meta if self._step_out_meta is not None else self.output_meta
