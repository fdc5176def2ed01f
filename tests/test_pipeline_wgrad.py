"""Batched weight gradients of a pipeline stage's linear layers (torchdist_ext/pipeline/_wgrad.py), in
one process: deferred gradients equal autograd's per-micro-batch ones within fp32 rounding once
flushed, input gradients come at once, the module is never modified, and layers that must see
their gradients during backward (hooks, frozen, checkpointed, autocast) are left to autograd."""
import contextlib
import copy
import pickle

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from torchdist_ext.pipeline._wgrad import WeightGradBatcher


class Sub(nn.Linear):
    def forward(self, x):
        return super().forward(x)


def _model():
    torch.manual_seed(0)
    frozen = nn.Linear(6, 6)
    frozen.weight.requires_grad_(False)
    frozen.bias.requires_grad_(False)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 6, bias=False), frozen, Sub(6, 4))


def _microbatches():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 6, generator=g), torch.randn(2, 3, 6, generator=g), torch.randn(1, 6, generator=g)]


def _run(model, batcher=None, forward=None):
    """Forward (captured by ``batcher`` if given) and backward of every micro-batch; input gradients."""
    grads = []
    for x in _microbatches():
        x = x.clone().requires_grad_(True)
        with batcher.capture() if batcher is not None else contextlib.nullcontext():
            out = (forward or model)(x)
        out.pow(2).sum().backward()
        grads.append(x.grad)
    return grads


def _pair(forward=None):
    """(reference model and its input gradients, a copy run under a batcher, its batcher and input gradients)."""
    ref = _model()
    ref_dx = _run(ref, forward=forward and (lambda x: forward(ref, x)))
    model = copy.deepcopy(ref)
    for p in model.parameters():
        p.grad = None
    batcher = WeightGradBatcher(model)
    dx = _run(model, batcher, forward=forward and (lambda x: forward(model, x)))
    return ref, ref_dx, model, batcher, dx


def _same_grads(model, ref, exact=False):
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if q.grad is None:
            assert p.grad is None, n
        elif exact:
            assert torch.equal(p.grad, q.grad), n
        else:
            torch.testing.assert_close(p.grad, q.grad, msg=n)


def test_deferred_weight_grads_match_autograd_after_flush():
    ref, ref_dx, model, batcher, dx = _pair()
    for a, b in zip(dx, ref_dx):  # input gradients at once
        torch.testing.assert_close(a, b)
    assert model[0].weight.grad is None and model[2].weight.grad is None  # deferred
    assert model[4].weight.grad is not None  # a subclass of nn.Linear with its own forward: left alone
    assert model[0].bias.grad is None and batcher.pending_bytes() > 0
    batcher.flush()
    assert batcher.pending_bytes() == 0
    _same_grads(model, ref)


def test_outside_capture_nothing_changes_and_the_module_is_untouched():
    ref = _model()
    ref_dx = _run(ref)
    model = copy.deepcopy(ref)
    for p in model.parameters():
        p.grad = None
    batcher = WeightGradBatcher(model)
    for a, b in zip(_run(model), ref_dx):
        assert torch.equal(a, b)
    _same_grads(model, ref, exact=True)
    assert batcher.pending_bytes() == 0
    assert not any("forward" in vars(m) for m in model.modules())
    clone = copy.deepcopy(model)  # copies and pickles are plain modules
    with torch.no_grad():
        clone[0].weight.zero_()
    assert not torch.equal(clone(torch.ones(1, 6)), model(torch.ones(1, 6)))
    pickle.loads(pickle.dumps(model))


def test_layers_that_must_see_their_gradients_are_left_to_autograd():
    model = _model()
    seen = []
    model[2].weight.register_hook(lambda g: seen.append(g))  # a gradient hook
    model[0].weight.requires_grad_(False)  # frozen after the batcher was built
    batcher = WeightGradBatcher(model)
    _run(model, batcher)
    assert len(seen) == 3 and all(g is not None for g in seen)
    assert model[2].weight.grad is not None  # not deferred
    assert model[0].weight.grad is None and model[0].bias.grad is not None  # frozen weight: a plain layer
    batcher.flush()
    assert model[0].weight.grad is None


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_layers_give_autograd_gradients(reentrant):
    def forward(m, x):
        return m[2:](checkpoint(m[:2], x, use_reentrant=reentrant))

    ref, ref_dx, model, batcher, dx = _pair(forward)
    for a, b in zip(dx, ref_dx):
        torch.testing.assert_close(a, b)
    batcher.flush()
    _same_grads(model, ref)


def test_autocast_and_no_grad_run_the_plain_op():
    model = _model()
    batcher = WeightGradBatcher(model)
    with batcher.capture(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.ones(2, 6)).float().sum().backward()
    assert batcher.pending_bytes() == 0 and model[0].weight.grad is not None
    with batcher.capture(), torch.no_grad():
        out = model(torch.ones(2, 6))
    assert batcher.pending_bytes() == 0
    assert torch.equal(out, _model()(torch.ones(2, 6)).detach())


def test_parametrized_and_keyword_called_layers():
    torch.manual_seed(0)
    ref = nn.Linear(6, 3)
    model = copy.deepcopy(ref)
    nn.utils.parametrizations.weight_norm(ref)
    nn.utils.parametrizations.weight_norm(model)
    batcher = WeightGradBatcher(model)
    x = torch.randn(4, 6)
    with batcher.capture():
        model(input=x).sum().backward()  # a computed weight: the plain op, autograd's gradients
    ref(x).sum().backward()
    assert batcher.pending_bytes() == 0
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)


def test_clear_drops_what_is_pending():
    model = _model()
    batcher = WeightGradBatcher(model)
    _run(model, batcher)
    batcher.clear()
    assert batcher.pending_bytes() == 0
    batcher.flush()
    assert model[0].weight.grad is None
