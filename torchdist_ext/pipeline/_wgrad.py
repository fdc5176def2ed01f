"""Batched weight gradients of the ``nn.Linear`` layers of a pipeline stage.

A micro-batch's backward through a linear layer computes ``dW = dY^T X`` (an (out, in) matrix from
a product over only the micro-batch's rows) and adds it into ``weight.grad``: with small
micro-batches that costs about a full read and write of the weight matrix per micro-batch, and in
1F1B, where forwards and backwards alternate, it also evicts the weights the next forward reads.
Here the backward computes the input gradient ``dX = dY W`` at once (the previous stage is waiting
for it) and keeps ``(X, dY)``; ``flush()`` then forms one product over the rows of several
micro-batches and adds it into ``.grad`` once. Same sums as autograd's, in another order: the
gradients agree within floating-point rounding.

Only while ``capture()`` is active (the stage's forward of a training step) do the stage's
``nn.Linear`` modules (those running nn.Linear's own forward) carry a forward of ours, set on the
instance and removed on exit, so copies, pickles and any use outside a pipeline step see the plain
module. Even then a call runs the plain op when batching is not safe: grad disabled, autocast on,
mixed dtypes, a frozen weight, a weight that is not a leaf (computed by a parametrization such as
weight_norm), a weight or bias with hooks registered on the tensor (they would see no gradient
during backward), or saved-tensor hooks in force (``torch.utils.checkpoint`` recomputes with the
plain op and checks that the same tensors were saved) unless they declare themselves observers by
an attribute ``tdx_observe_only = True`` on their pack function. Not detected: hooks registered on
a weight's gradient-accumulator node, or on the tensor after the forward; they see no gradient for
a batched layer. Such code should build its stages with ``batch_weight_grads=False``.

Not used under a schedule with ``I``/``W`` actions (zero-bubble): its ``W`` already computes a
micro-batch's weight gradients apart, and autograd's split of the layers (``_backward.py``) costs
less CPU there than keeping pairs through this Python autograd Function (1 rank, two stages in a V,
width 256: 0.73-0.98x the CPU time per step with it off, equal at width 512).
"""
import contextlib
import types

import torch
import torch.nn.functional as F
from torch import nn


class _LinearKeepW(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, sink):
        ctx.save_for_backward(x, weight)
        ctx.sink = sink
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None
        # detached: the kept input must not hold the micro-batch's autograd graph alive
        ctx.sink.append((x.detach().reshape(-1, x.shape[-1]), dy.detach().reshape(-1, dy.shape[-1]),
                         ctx.needs_input_grad[1], ctx.needs_input_grad[2]))
        return dx, None, None, None


def _has_grad_hooks(t):
    return t is not None and bool(t._backward_hooks or getattr(t, "_post_accumulate_grad_hooks", None))


def _autocast_on(device_type):
    try:
        return torch.is_autocast_enabled(device_type)
    except RuntimeError:  # a device type autocast does not know (meta, ...): nothing to cast
        return False


def _saved_tensor_hooks_in_force():
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return True  # cannot tell: assume they are
    hooks = top(False)
    return hooks is not None and not getattr(hooks[0], "tdx_observe_only", False)


def planned(layer):
    """Whether ``layer`` (an ``nn.Linear``) batches its weight gradients by default: the decision
    room's rule (``_C.tuning.batch_weight_grads``, csrc/tuning/pipeline.h), by the weight's size."""
    from .. import _C

    return _C.tuning.batch_weight_grads(layer.in_features, layer.out_features)


class WeightGradBatcher:
    """Defers the weight and bias gradients of ``module``'s linear layers; see the module doc.

    ``choose(layer) -> bool`` picks the layers that batch (None: every one); :func:`planned` is the
    default of ``PipelineStage``. ``layers`` says how many were picked.
    """

    def __init__(self, module, choose=None):
        self._sinks = {}  # (weight, bias) -> [(x, dy, weight needs grad, bias needs grad)]
        self._forwards = [(m, self._forward_of(m)) for m in module.modules()
                          if isinstance(m, nn.Linear) and type(m).forward is nn.Linear.forward
                          and (choose is None or choose(m))]
        self.layers = len(self._forwards)

    def _forward_of(self, mod):
        batcher = self

        def forward(self, input):  # nn.Linear.forward's signature; bound, so a copy reads its own weights
            sink = batcher._sink_for(input, self.weight, self.bias)
            if sink is None:
                return F.linear(input, self.weight, self.bias)
            return _LinearKeepW.apply(input, self.weight, self.bias, sink)

        return types.MethodType(forward, mod)

    @contextlib.contextmanager
    def capture(self):
        """Batch the linear layers' weight gradients of the forwards run inside (a training step's)."""
        placed = []
        for mod, forward in self._forwards:
            if "forward" not in mod.__dict__:  # leave an instance forward someone else set alone
                mod.__dict__["forward"] = forward
                placed.append(mod)
        try:
            yield
        finally:
            for mod in placed:
                mod.__dict__.pop("forward", None)

    def _sink_for(self, x, weight, bias):
        # leaves only: a weight computed per call (weight_norm, spectral_norm, other parametrizations)
        # would take the gradient its parameters need
        if (not weight.requires_grad or not weight.is_leaf or (bias is not None and not bias.is_leaf)
                or not torch.is_grad_enabled() or type(x) is not torch.Tensor
                or x.dim() < 1 or x.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype)
                or _has_grad_hooks(weight) or _has_grad_hooks(bias)
                or _autocast_on(x.device.type) or _saved_tensor_hooks_in_force()):
            return None
        return self._sinks.setdefault((weight, bias), [])

    def pending_bytes(self):
        """Bytes of inputs and output gradients kept for the next flush."""
        return sum(x.nbytes + d.nbytes for sink in self._sinks.values() for x, d, _, _ in sink)

    @torch.no_grad()
    def flush(self):
        """Adds the kept micro-batches' weight and bias gradients into ``.grad``."""
        for (weight, bias), sink in self._sinks.items():
            if not sink:
                continue
            kept = list(sink)
            sink.clear()
            for_weight = [(x, dy) for x, dy, needs_w, _ in kept if needs_w]
            if for_weight:
                _accumulate(weight, _cat([dy for _, dy in for_weight]).t().matmul(_cat([x for x, _ in for_weight])))
            for_bias = [dy for _, dy, _, needs_b in kept if needs_b]
            if bias is not None and for_bias:
                _accumulate(bias, _cat(for_bias).sum(0))

    def clear(self):
        for sink in self._sinks.values():
            sink.clear()


def _cat(ts):
    return ts[0] if len(ts) == 1 else torch.cat(ts)


def _accumulate(param, grad):
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)
