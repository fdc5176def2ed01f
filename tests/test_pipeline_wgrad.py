"""Batched weight gradients of a pipeline stage's nn.Linear layers (torchdist_ext/pipeline/_wgrad.py),
in one process: deferred gradients equal autograd's per-micro-batch ones within fp32 rounding once
flushed, input gradients come at once, and outside a pipeline forward the modules are untouched."""
import copy

import torch
from torch import nn

from torchdist_ext.pipeline._wgrad import WeightGradBatcher


class Sub(nn.Linear):
    pass


def _model():
    torch.manual_seed(0)
    frozen = nn.Linear(6, 6)
    frozen.weight.requires_grad_(False)
    frozen.bias.requires_grad_(False)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 6, bias=False), frozen, Sub(6, 4))


def _microbatches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 6, generator=g), torch.randn(2, 3, 6, generator=g), torch.randn(1, 6, generator=g)]


def _run(model, batcher=None, active=False):
    """Forward and backward of every micro-batch; returns the input gradients."""
    grads = []
    for x in _microbatches():
        x = x.clone().requires_grad_(True)
        if batcher is not None:
            batcher.active = active
        out = model(x)
        if batcher is not None:
            batcher.active = False
        out.pow(2).sum().backward()
        grads.append(x.grad)
    return grads


def _reference_and_batched(active):
    """(reference model, its input gradients, batched copy, its batcher, its input gradients)."""
    ref = _model()
    ref_dx = _run(ref)
    model = copy.deepcopy(ref)
    for p in model.parameters():
        p.grad = None
    batcher = WeightGradBatcher(model)
    return ref, ref_dx, model, batcher, _run(model, batcher, active=active)


def test_deferred_weight_grads_match_autograd_after_flush():
    ref, ref_dx, model, batcher, dx = _reference_and_batched(active=True)
    for a, b in zip(dx, ref_dx):  # input gradients at once
        torch.testing.assert_close(a, b)
    assert model[0].weight.grad is None and model[2].weight.grad is None  # deferred
    assert model[4].weight.grad is not None  # a subclass of nn.Linear runs its own forward
    assert batcher.pending_bytes() > 0
    batcher.flush()
    assert batcher.pending_bytes() == 0
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if q.grad is None:
            assert p.grad is None, n
        else:
            torch.testing.assert_close(p.grad, q.grad, msg=n)


def test_inactive_batcher_changes_nothing():
    ref, ref_dx, model, batcher, dx = _reference_and_batched(active=False)
    for a, b in zip(dx, ref_dx):
        assert torch.equal(a, b)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad), n
    assert batcher.pending_bytes() == 0


def test_only_trainable_exact_linear_layers_are_batched():
    model = _model()
    WeightGradBatcher(model)
    patched = [i for i, m in enumerate(model) if "forward" in vars(m)]
    assert patched == [0, 2]  # not the frozen Linear, not the subclass, not Tanh


def test_clear_drops_what_is_pending():
    model = _model()
    batcher = WeightGradBatcher(model)
    _run(model, batcher, active=True)
    batcher.clear()
    assert batcher.pending_bytes() == 0
    batcher.flush()
    assert model[0].weight.grad is None


def test_no_grad_forward_is_plain():
    model = _model()
    batcher = WeightGradBatcher(model)
    batcher.active = True
    with torch.no_grad():
        out = model(torch.ones(2, 6))
    batcher.active = False
    assert torch.equal(out, _model()(torch.ones(2, 6)).detach())
    assert batcher.pending_bytes() == 0
