"""Tensor parallelism against the single-process model, rank by rank: for every layer and plan style
(ours, torch's, Megatron's), each rank's output, every parameter's gradient (replicated ones
included) and the parameters after several optimizer steps equal that rank's slice of the unsplit
model's, at TP = 2 and 4. The models have replicated layers (LayerNorm, Linear) before and after the
tensor-parallel ones, so a gradient that is wrong on one rank only, or replicated weights drifting
apart, shows. One spawned run per world size checks every configuration."""
import contextlib

import pytest
import torch
import torch.nn.functional as F

from _dist import run_ranks
from _tp_models import B, FF, H, S, V, MegatronNet, Net
from torchdist_ext import tensor_parallel as tp

STEPS = 3


class Case:
    """One configuration: the model (this rank's TP model, or the unsplit one with rank None), how to
    run it and score it, and along which dim its output is split (None: replicated)."""

    def __init__(self, model, loss, out_dim=-1, forward=None, ctx=None, inputs="ids"):
        self.model, self.loss, self.out_dim, self.inputs = model, loss, out_dim, inputs
        self.forward = forward or (lambda m, x: m(x))
        self.ctx = ctx or contextlib.nullcontext


def _ce(out, tgt):
    return F.cross_entropy(out.flatten(0, 1), tgt.flatten())


def _plan_strings():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    plan = {"emb": "vocab", "head": "vocab", "mid_a": ColwiseParallel(output_layouts=Replicate()),
            "mid_b": RowwiseParallel(input_layouts=Replicate())}
    for i in range(2):
        plan.update({f"layers.{i}.attn.{n}": "colwise" for n in "qkv"})
        plan.update({f"layers.{i}.attn.o": "rowwise", f"layers.{i}.mlp.fc1": "colwise", f"layers.{i}.mlp.fc2": "rowwise"})
    return plan


def _make(name, rank, ws):
    """The Case ``name`` for ``rank`` of ``ws`` (rank None: the unsplit model)."""
    torch.manual_seed(0)
    if name == "strings":
        m = Net()
        if rank is not None:
            tp.parallelize_module(m, None, _plan_strings())
        return Case(m, _ce if rank is None else tp.vocab_parallel_cross_entropy)
    raise KeyError(name)


CONFIGS = ["strings"]


def _data(inputs):
    torch.manual_seed(7)
    if inputs == "ids":
        x, tgt = torch.randint(0, V, (B, S)), torch.randint(0, V, (B, S))
        tgt[0, 1] = -100
        return x, tgt
    return torch.randn(B, S, H), torch.randn(B, S, H)


def _train(case):
    """STEPS optimizer steps; returns (losses, first output, first gradients, final state)."""
    m = case.model
    x, tgt = _data(case.inputs)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    losses, out0, grads0 = [], None, None
    for step in range(STEPS):
        opt.zero_grad()
        with case.ctx():
            out = case.forward(m, x)
            loss = case.loss(out, tgt)
            loss.backward()
        if step == 0:
            out0 = (out.to_local() if hasattr(out, "to_local") else out).detach().clone()
            grads0 = {k: p.grad.clone() for k, p in m.state_dict(keep_vars=True).items() if p.grad is not None}
        opt.step()
        losses.append(loss.detach())
    return losses, out0, grads0, {k: v.clone() for k, v in m.state_dict().items()}


def _ranks(rank, ws):
    results = {}
    for name in CONFIGS:
        case = _make(name, rank, ws)
        results[name] = _train(case) + (tp.tp_layout(case.model), case.out_dim)
    return results


def _reference(name):
    return _train(_make(name, None, 1))


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("ws", [2, 4])
def test_every_rank_matches_the_single_process_model(ws):
    refs = {name: _reference(name) for name in CONFIGS}
    out = run_ranks(_ranks, ws, timeout=240)
    for rank, res in enumerate(out):
        for name, (losses, out0, grads0, state, layout, out_dim) in res.items():
            r_losses, r_out0, r_grads0, r_state = refs[name]
            where = f"{name}, TP={ws}, rank {rank}"
            _close(out0, r_out0 if out_dim is None else r_out0.chunk(ws, out_dim)[rank], f"{where}: output")
            _close(losses[0], r_losses[0], f"{where}: loss")
            r_grads = tp.shard_state_dict(r_grads0, layout, ws, rank)
            assert set(grads0) == set(r_grads), f"{where}: gradients of {sorted(set(grads0) ^ set(r_grads))}"
            for k in r_grads:
                _close(grads0[k], r_grads[k], f"{where}: gradient of {k}")
            for i, (l, rl) in enumerate(zip(losses, r_losses)):
                _close(l, rl, f"{where}: loss at step {i}")
            r_state = tp.shard_state_dict(r_state, layout, ws, rank)
            assert set(state) == set(r_state)
            for k in r_state:
                _close(state[k], r_state[k], f"{where}: {k} after {STEPS} steps")
