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
from _tp_models import B, H, S, V, KwargNet, MegatronNet, Net, run_sharded
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


def _plan(name):
    """Net's plan in three spellings: ours (strings, with torch's styles where a string has no
    spelling), ours under sequence parallelism, and torch's sequence-parallel recipe (wildcards,
    PrepareModuleInput/Output, a first MLP run unsharded between PrepareModuleInputOutput's
    conversions, a DTensor head for loss_parallel)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                                   PrepareModuleOutput, RowwiseParallel, SequenceParallel)
    if name == "torch_sp":
        return {"emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                "ln0": SequenceParallel(), "pre": SequenceParallel(), "layers.*.ln[12]": SequenceParallel(),
                "layers.*.attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "layers.*.attn.[qkv]": ColwiseParallel(), "layers.*.attn.o": RowwiseParallel(output_layouts=Shard(1)),
                "layers.0.mlp": PrepareModuleInputOutput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
                                                         output_layouts=Replicate(), desired_output_layouts=Shard(1)),
                "layers.0.mlp.fc1": ColwiseParallel(), "layers.0.mlp.fc2": RowwiseParallel(),
                "layers.1.mlp.fc1": ColwiseParallel(input_layouts=Shard(1)),
                "layers.1.mlp.fc2": RowwiseParallel(output_layouts=Shard(1)),
                "layers.1": PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate()),
                "mid_a": ColwiseParallel(output_layouts=Replicate()),
                "mid_b": RowwiseParallel(input_layouts=Replicate()),
                "head": ColwiseParallel(use_local_output=False)}
    sp = name == "strings_sp"
    plan = {"emb": RowwiseParallel(input_layouts=Replicate()) if not sp else "vocab", "head": "vocab",
            "layers.*.attn.q": "colwise", "layers.*.attn.k": "colwise", "layers.*.attn.v": "colwise",
            "layers.*.attn.o": "rowwise", "layers.*.mlp.fc1": "colwise", "layers.*.mlp.fc2": "rowwise",
            "mid_a": ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Replicate()),
            "mid_b": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate())}
    if sp:
        plan.update({k: "sequence" for k in ("ln0", "pre", "layers.*.ln1", "layers.*.ln2", "ln_f")})
    return plan


def _kwarg_plan():
    """KwargNet's plan: PrepareModuleInput converts the block's positional input and its keyword
    ``ctx`` from Replicate() to Shard(1) (``scale``, a number, has no layout), the block's layers run
    sequence-parallel and hand on Shard(1), and a keyword-only PrepareModuleInput gathers ``skip``
    back to Replicate()."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel
    return {"block": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                        input_kwarg_layouts={"ctx": Replicate()},
                                        desired_input_kwarg_layouts={"ctx": Shard(1)}),
            "block.fc1": ColwiseParallel(input_layouts=Shard(1)),
            "block.fc2": RowwiseParallel(output_layouts=Shard(1)),
            "skip": PrepareModuleInput(input_kwarg_layouts={"skip": Shard(1)},
                                       desired_input_kwarg_layouts={"skip": Replicate()})}


def _megatron(m, sp):
    """MegatronNet's layers replaced by hand, as Megatron code builds them."""
    m.fc1 = tp.ColumnParallelLinear.from_module(m.fc1, skip_bias_add=True, sequence_parallel=sp)
    m.fc2 = tp.RowParallelLinear.from_module(m.fc2, skip_bias_add=True, sequence_parallel=sp)
    m.c = tp.ColumnParallelLinear.from_module(m.c, gather_output=True, sequence_parallel=sp)
    m.d = tp.RowParallelLinear.from_module(m.d, input_is_parallel=False, skip_bias_add=True, sequence_parallel=sp)
    if sp:
        for n in ("ln_a", "pre", "ln_b", "out"):
            tp.mark_sequence_parallel(getattr(m, n))
    return m


def _make(name, rank, ws):
    """The Case ``name`` for ``rank`` of ``ws`` (rank None: the unsplit model). Ranks start from
    different seeds where parallelize_module's src_data_rank=0 must make them agree; the reference
    is rank 0's model."""
    if name.startswith("megatron"):
        torch.manual_seed(100)
        m, sp = MegatronNet(), name == "megatron_sp"
        if rank is None:
            return Case(m, F.mse_loss, None, inputs="x")
        return Case(_megatron(m, sp), F.mse_loss, None, inputs="x",
                    forward=lambda m, x: run_sharded(m, x, None, sp))
    if name == "torch_kwargs":
        torch.manual_seed(100 + (rank or 0))
        m = KwargNet()
        if rank is not None:
            tp.parallelize_module(m, None, _kwarg_plan())
        return Case(m, F.mse_loss, None, inputs="x")
    torch.manual_seed(100 + (rank or 0))
    m = Net(tied=name == "strings", padding_idx=1 if name == "strings" else None)
    if rank is None:
        return Case(m, _ce)
    if name == "torch_sp":  # torch's call, keywords included
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor.parallel import loss_parallel
        tp.parallelize_module(m, device_mesh=DeviceMesh.from_group(dist.group.WORLD, "cpu"),
                              parallelize_plan=_plan(name))
        return Case(m, _ce, ctx=loss_parallel)
    tp.parallelize_module(m, None, _plan(name), sequence_parallel=name == "strings_sp")
    return Case(m, tp.vocab_parallel_cross_entropy)


CONFIGS = ["strings", "strings_sp", "torch_sp", "torch_kwargs", "megatron", "megatron_sp"]


def _data(inputs):
    torch.manual_seed(7)
    if inputs == "ids":
        x, tgt = torch.randint(0, V, (B, S)), torch.randint(0, V, (B, S))
        x[1, 2], tgt[0, 1] = 1, -100  # a padding id (padding_idx=1 where set), an ignored target
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
        losses.append((loss.full_tensor() if hasattr(loss, 'full_tensor') else loss).detach())
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


def _snapshot(m):
    return ([type(x).__name__ for x in m.modules()], {k: v.clone() for k, v in m.state_dict().items()},
            sum(len(x._forward_pre_hooks) + len(x._forward_hooks) for x in m.modules()), m.head.weight is m.emb.weight)


def _bad_plans_rank(rank, ws):
    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor.parallel import PrepareModuleInput, RowwiseParallel
    good = {"layers.*.attn.q": "colwise", "layers.*.attn.o": "rowwise"}  # valid entries listed first
    cases = [(False, {"ln0": "colwise"}), (False, {"layers.0.attn": "rowwise"}),
             (True, {"emb": "vocab"}),                      # head tied to it stays replicated
             (True, {"emb": "vocab", "head": "rowwise"}),   # split by dim 0 and by dim 1
             (False, {"layers.*.attn.x": "colwise"}), (False, {"layers.0.attn.q": "rowwise"}),
             (False, {"emb": RowwiseParallel()}),
             (False, {"layers.0": PrepareModuleInput(input_layouts=Partial(), desired_input_layouts=Replicate())}),
             (False, {"pre": "vocab", "ln_f": "sequence"}), ("max_norm", {"emb": "vocab"})]
    msgs = []
    for tied, bad in cases:
        torch.manual_seed(rank)
        m = Net(tied=tied is True)
        if tied == "max_norm":
            m.emb.max_norm = 1.0
        before = _snapshot(m)
        try:
            tp.parallelize_module(m, None, {**good, **bad}, src_data_rank=0)
            msgs.append(None)
        except (ValueError, TypeError) as e:
            msgs.append(str(e))
        after = _snapshot(m)
        assert before[0] == after[0] and before[2:] == after[2:], (bad, before, after)
        for k, v in before[1].items():
            assert torch.equal(v, after[1][k]), (bad, k)
    try:  # src_data_rank outside the group
        tp.parallelize_module(Net(), None, good, src_data_rank=ws)
    except ValueError as e:
        msgs.append(str(e))
    logits, tgt = torch.randn(2, 3, V // ws), torch.zeros(2, 3, dtype=torch.long)
    tgt[1, 2] = V if rank == 1 else -100  # rank 1 alone holds a bad target: both ranks raise
    try:
        tp.vocab_parallel_cross_entropy(logits, tgt)
    except IndexError as e:
        msgs.append(str(e))
    # An ignore_index outside the vocabulary is ignored, not out of bounds (F.cross_entropy's rule).
    torch.manual_seed(3)
    full_logits, tgt = torch.randn(2, 3, V), torch.randint(0, V, (2, 3))
    tgt[0, 0] = V
    ce = (tp.vocab_parallel_cross_entropy(full_logits.chunk(ws, -1)[rank], tgt, ignore_index=V),
          F.cross_entropy(full_logits.flatten(0, 1), tgt.flatten(), ignore_index=V))
    # Tied and padded: a state dict saved unsplit loads at this degree and the tie holds.
    torch.manual_seed(5)
    full = Net(tied=True, padding_idx=1)
    torch.manual_seed(6 + rank)
    m = tp.parallelize_module(Net(tied=True, padding_idx=1), None, _plan("strings"), src_data_rank=None)
    m.load_state_dict(tp.shard_state_dict(full.state_dict(), tp.tp_layout(m), ws, rank))
    return msgs, m.head.weight is m.emb.weight, {k: v.clone() for k, v in m.state_dict().items()}, tp.tp_layout(m), ce


def test_bad_plans_leave_the_model_untouched():
    """Every entry is checked before anything changes: a bad entry after good ones raises on every
    rank before any communication, and the model keeps its modules, values, hooks and ties. A target
    outside the vocabulary raises on every rank (an ignore_index there is ignored). A tied, padded model
    loads an unsplit state dict."""
    out = run_ranks(_bad_plans_rank, 2, timeout=120, pg_timeout=30)
    expect = ["'ln0' is a LayerNorm; 'colwise' applies to nn.Linear", "'layers.0.attn' is a Attention",
              "['emb.weight', 'head.weight'] are one tied parameter", "head.weight by dim 1",
              "plan keys ['layers.*.attn.x'] match no submodule",
              "'layers.0.attn.q' is named by plan keys 'layers.*.attn.q' and 'layers.0.attn.q'",
              "RowwiseParallel on an nn.Embedding needs input_layouts=Replicate()",
              "input layout Partial(sum) -> Replicate() is not supported", "'sequence' marks a module",
              "option(s) ['max_norm'] are not supported",
              "src_data_rank = 2 is not a rank of the tensor-parallel group"]
    torch.manual_seed(5)
    full = Net(tied=True, padding_idx=1).state_dict()
    shards = []
    for rank, (msgs, tied, sd, _, ce) in enumerate(out):
        _close(*ce, f"rank {rank}: cross-entropy with ignore_index=V")
        for i, e in enumerate(expect):
            assert msgs[i] is not None and e in msgs[i], (i, msgs[i])
        assert "out of bounds for a vocabulary of 16 classes" in msgs[-1]
        assert ("target 16" if rank == 1 else "a target on another rank") in msgs[-1]
        assert tied
        shards.append(sd)
    merged = tp.merge_shards(shards, out[0][3])
    for k, v in full.items():
        torch.testing.assert_close(merged[k], v, msg=lambda m: f"{k}: {m}")
