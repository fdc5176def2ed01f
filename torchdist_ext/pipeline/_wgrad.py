"""Batched weight gradients for a stage's ``nn.Linear`` layers.

A micro-batch's backward through ``nn.Linear`` computes ``dW = dY^T X`` (an (out, in) matrix from
a product over only the micro-batch's rows) and adds it into ``weight.grad``: with small
micro-batches that costs about a full read and write of the weight matrix per micro-batch, and in
1F1B, where forwards and backwards alternate, it also evicts the weights the next forward reads.
Here the backward computes the input gradient ``dX = dY W`` at once (the previous stage is waiting
for it) and keeps ``(X, dY)``; ``flush()`` then forms one product over the rows of several
micro-batches and adds it into ``.grad`` once. Same sums as autograd's, in another order: the
gradients agree within floating-point rounding.

Only exact ``nn.Linear`` modules whose weight requires grad take part, and only inside a pipeline
step's forward (``active``); elsewhere the module runs its own forward.
"""
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
        ctx.sink.append((x.detach().reshape(-1, x.shape[-1]), dy.detach().reshape(-1, dy.shape[-1])))
        return dx, None, None, None


class WeightGradBatcher:
    """Defers the weight and bias gradients of ``module``'s ``nn.Linear`` layers; see the module doc."""

    def __init__(self, module):
        self.active = False
        self._sinks = {}
        for mod in module.modules():
            if type(mod) is nn.Linear and mod.weight.requires_grad:
                sink = []
                self._sinks[mod] = sink
                mod.forward = self._forward_of(mod, sink)

    def _forward_of(self, mod, sink):
        plain = nn.Linear.forward.__get__(mod)

        def forward(x):
            if (not self.active or not torch.is_grad_enabled() or not isinstance(x, torch.Tensor)
                    or x.dtype != mod.weight.dtype or x.dim() < 1):
                return plain(x)
            return _LinearKeepW.apply(x, mod.weight, mod.bias, sink)

        return forward

    def __bool__(self):
        return bool(self._sinks)

    def pending_bytes(self):
        """Bytes of inputs and output gradients kept for the next flush."""
        return sum(x.nbytes + d.nbytes for sink in self._sinks.values() for x, d in sink)

    @torch.no_grad()
    def flush(self):
        """Adds the kept micro-batches' weight and bias gradients into ``.grad``."""
        for mod, sink in self._sinks.items():
            if not sink:
                continue
            xs, dys = zip(*sink)
            sink.clear()
            x = xs[0] if len(xs) == 1 else torch.cat(xs)
            dy = dys[0] if len(dys) == 1 else torch.cat(dys)
            _accumulate(mod.weight, dy.t().matmul(x))
            if mod.bias is not None and mod.bias.requires_grad:
                _accumulate(mod.bias, dy.sum(0))

    def clear(self):
        for sink in self._sinks.values():
            sink.clear()


def _accumulate(param, grad):
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)
