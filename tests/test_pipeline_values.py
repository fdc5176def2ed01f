"""Values between stages that are more than tensors: a dict, nested tuples, an integer tensor, None,
numbers and strings (one of them different in every micro-batch) pass from stage to stage; losses,
gradients and parameters equal the unsplit model's with 2 and 4 stages, 1F1B and ZB-V (whose V hands
values over on one rank), on tdx and gloo."""
import pytest
import torch
from torch import nn

from _dist import run_ranks
from _pipe_runs import assert_matches, reference_steps, train_steps

BATCH, WIDTH, CLASSES, STEPS, LR, M = 8, 6, 3, 2, 0.1, 4


class _ToDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        # the row offset differs per micro-batch: a Python value that is not the same every time
        return {"h": torch.tanh(self.lin(x)), "aux": (x.sum(-1), "tag"), "scale": 0.5,
                "rows": torch.arange(x.shape[0]), "first": float(x[0, 0])}


class _FromDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, d):
        if d["aux"][1] != "tag" or d["rows"].dtype != torch.int64 or d["first"] != pytest.approx(d["aux"][0][0].item(),
                                                                                                   abs=10):
            raise AssertionError(f"values arrived changed: {d}")
        h = d["h"] * d["scale"] + d["aux"][0][:, None] / 10 + d["rows"][:, None] / 100
        return self.lin(h), None, 3  # a tuple: the next stage gets three positional arguments


class _Three(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, h, nothing, k):
        if nothing is not None or k != 3:
            raise AssertionError(f"positional values arrived changed: {nothing!r}, {k!r}")
        return [torch.tanh(self.lin(h)) * k, h]  # a list of tensors: unpacked like a tuple


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2 * WIDTH, CLASSES)

    def forward(self, a, b):
        return self.lin(torch.cat([a, b], dim=-1))


class _Chain(nn.Module):
    """Several of the blocks above as one stage, passing values the way stages do."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, *args):
        for b in self.blocks:
            out = b(*args)
            args = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        return out


def _parts(n_stages):
    torch.manual_seed(0)
    blocks = [_ToDict(), _FromDict(), _Three(), _Head()]
    if n_stages == 4:
        return blocks
    return [_Chain(blocks[:1]), _Chain(blocks[1:])]


def _batch(step):
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


def _reference(n_stages):
    parts = _parts(n_stages)
    chain = _Chain(parts)

    def loss_of(x, y):
        # the pipeline averages micro-batch losses; the row numbers passed between stages are per micro-batch,
        # so the reference runs the micro-batches too
        losses = [nn.functional.cross_entropy(chain(xi), yi) for xi, yi in zip(x.chunk(M), y.chunk(M))]
        return torch.stack(losses).mean()
    return reference_steps(parts, _batch, STEPS, LR, loss_of)


def _train(rank, ws, kind, n_stages):
    from torchdist_ext.pipeline import PipelineStage, Schedule1F1B, ScheduleZBVZeroBubble

    parts = _parts(n_stages)
    mine = [rank, 2 * ws - 1 - rank] if kind == "zbv" else [rank]
    stages = [PipelineStage(parts[s], s, n_stages, "cpu") for s in mine]
    loss_fn = nn.functional.cross_entropy
    sched = ScheduleZBVZeroBubble(stages, M, loss_fn=loss_fn) if kind == "zbv" else Schedule1F1B(stages[0], M,
                                                                                                  loss_fn=loss_fn)
    return train_steps(sched, parts, mine, n_stages, _batch, STEPS, LR)


def _run(rank, ws, configs):
    return {c: _train(rank, ws, *c) for c in configs}


def _check(results, config):
    assert_matches([r[config] for r in results], _reference(config[1]), str(config))


@pytest.mark.parametrize("backend", ["tdx", "gloo"])
def test_structured_values_between_stages(backend):
    configs = [("1f1b", 2), ("zbv", 4)]  # 2 ranks: one stage each; two each in a V
    results = run_ranks(_run, 2, configs, backend=backend)
    for c in configs:
        _check(results, c)


def test_structured_values_four_stages():
    results = run_ranks(_run, 4, [("1f1b", 4)])
    _check(results, ("1f1b", 4))


class _Block(nn.Module):
    """Takes a tensor or {"h", "s"}; ``emits_dict``: returns {"h", "s"} for micro-batches of 4 rows, else a tensor."""

    def __init__(self, out, emits_dict):
        super().__init__()
        self.lin, self.emits_dict = nn.Linear(WIDTH, out), emits_dict

    def forward(self, x):
        if isinstance(x, dict):
            x = x["h"] * x["s"]
        h = torch.tanh(self.lin(x))
        return {"h": h, "s": 2.0} if self.emits_dict and x.shape[0] == 4 else h


# batch sizes per step (M micro-batches): same shapes, new shapes, tensors -> values -> values -> tensors, same
_SIZES = [8, 8, 12, 16, 16, 8, 8]


def _shape_parts(n_stages):
    torch.manual_seed(1)
    blocks = [_Block(WIDTH, True), _Block(WIDTH, False), _Block(WIDTH, True), _Block(CLASSES, False)]
    return blocks if n_stages == 4 else [blocks[0], _Chain(blocks[1:])]


def _sized_batch(step):
    g = torch.Generator().manual_seed(30 + step)
    return torch.randn(_SIZES[step], WIDTH, generator=g), torch.randint(0, CLASSES, (_SIZES[step],), generator=g)


def _train_sized(rank, ws, configs):
    from torchdist_ext.pipeline import PipelineStage, Schedule1F1B, ScheduleZBVZeroBubble

    out = {}
    for kind, n_stages in configs:
        parts = _shape_parts(n_stages)
        mine = [rank, 2 * ws - 1 - rank] if kind == "zbv" else [rank]
        stages = [PipelineStage(parts[s], s, n_stages, "cpu") for s in mine]
        loss_fn = nn.functional.cross_entropy
        sched = (ScheduleZBVZeroBubble(stages, M, loss_fn=loss_fn) if kind == "zbv"
                 else Schedule1F1B(stages[0], M, loss_fn=loss_fn))
        out[(kind, n_stages)] = train_steps(sched, parts, mine, n_stages, _sized_batch, len(_SIZES), LR)
    return out


@pytest.mark.parametrize("backend", ["tdx", "gloo"])
def test_shapes_and_structure_change_between_steps(backend):
    """A stage given no input_args gets new shapes, then values with their own structure, then tensors
    again from one step to the next; every step still equals the unsplit model."""
    configs = [("1f1b", 2), ("zbv", 4)]
    results = run_ranks(_train_sized, 2, configs, backend=backend)
    for kind, n_stages in configs:
        parts = _shape_parts(n_stages)
        chain = _Chain(parts)

        def loss_of(x, y):
            return torch.stack([nn.functional.cross_entropy(chain(xi), yi)
                                for xi, yi in zip(x.chunk(M), y.chunk(M))]).mean()
        ref = reference_steps(parts, _sized_batch, len(_SIZES), LR, loss_of)
        assert_matches([r[(kind, n_stages)] for r in results], ref, f"{kind}, {n_stages} stages, {backend}")
