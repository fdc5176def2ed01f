"""A wrapped unit that runs, or gets gradients, on some ranks only (here a branch taken on rank 1
only) must not hang or silently mix units: every rank raises an error naming the unit and the
ranks, at once. A branch that shares a unit with parameters every rank uses trains correctly
(its gradient counts as zero where it was not used), as with torch's DDP."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from _dist import run_ranks
from test_fsdp import Block


class Branchy(nn.Module):
    """main and branch are Blocks of the same size: unchecked, their collectives would pair up
    without any size mismatch to notice."""

    def __init__(self, d=13):
        super().__init__()
        self.inp = nn.Linear(7, d)
        self.main = Block(d)
        self.branch = Block(d)
        self.head = nn.Linear(d, 5)

    def forward(self, x, run_branch=True):
        h = F.relu(self.inp(x))
        out = self.head(self.main(h))
        if not run_branch:
            return out, None
        return out, self.head(self.branch(h))


def _loss(model, rank, mode):
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, 7, generator=g), torch.randint(0, 5, (4,), generator=g)
    out, side = model(x, run_branch=(mode == "grad_only") or rank == 1)
    loss = F.cross_entropy(out, y)
    if rank == 1:
        loss = loss + side.square().mean()
    return loss


def _diverging(rank, ws, stage, mode):
    import torchdist_ext

    torch.manual_seed(0)
    model = torchdist_ext.FullyShardedDataParallel(
        Branchy(), stage=stage, auto_wrap_policy=torchdist_ext.ModuleWrapPolicy({Block}))
    try:
        for _ in range(2):
            _loss(model, rank, mode).backward()
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("ws,stage,mode", [(2, 3, "branch"), (3, 3, "branch"), (2, 1, "grad_only"),
                                           (3, 2, "grad_only"), (3, 3, "grad_only")])
def test_a_unit_used_on_some_ranks_only_raises_naming_it_on_every_rank(ws, stage, mode):
    # mode "branch": the branch runs on rank 1 only; "grad_only": it runs everywhere but only
    # rank 1's loss uses it. Either way only rank 1 has gradients for it.
    messages = run_ranks(_diverging, ws, stage, mode, timeout=120, pg_timeout=60)
    others = [r for r in range(ws) if r != 1]
    for rank, msg in enumerate(messages):
        assert msg is not None, f"rank {rank} raised nothing"
        assert "('branch', Block)" in msg and "ranks [1]" in msg and f"ranks {others}" in msg, f"rank {rank}: {msg}"


def _shared_unit(rank, ws):
    import torchdist_ext

    torch.manual_seed(0)
    model = torchdist_ext.FullyShardedDataParallel(Branchy(), stage=3)  # one unit: the branch shares it
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    _loss(model, rank, "branch").backward()
    opt.step()
    return torchdist_ext.full_state_dict(model)


@pytest.mark.parametrize("ws", [2, 3])
def test_a_branch_inside_a_shared_unit_counts_as_zero_where_unused(ws):
    sd = run_ranks(_shared_unit, ws)[0]
    torch.manual_seed(0)
    ref = Branchy()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    (sum(_loss(ref, r, "branch") for r in range(ws)) / ws).backward()
    opt.step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, atol=1e-6, rtol=1e-5, msg=lambda m: f"{k}: {m}")
