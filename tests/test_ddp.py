"""torchdist_ext.DistributedDataParallel against torch's DDP on the same backend: same parameters
bit for bit after N steps, world sizes 1-4."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from _dist import run_ranks


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(12, 40)
        self.b = nn.Linear(40, 40)
        self.c = nn.Linear(40, 5)

    def forward(self, x):
        return self.c(F.relu(self.b(F.relu(self.a(x)))))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 6 * 6, 5)

    def forward(self, x):
        return self.fc(F.relu(self.bn(self.conv(x))).flatten(1))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 12)
        self.mid = nn.Linear(12, 12)

    def forward(self, idx):
        h = torch.tanh(self.mid(self.emb(idx).mean(1)))
        return h @ self.emb.weight.t()  # the embedding is used again as the output layer


class Branchy(nn.Module):
    """`unused` never takes part; `sometimes` only on even steps (set by the test)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(12, 16)
        self.sometimes = nn.Linear(16, 16)
        self.unused = nn.Linear(16, 16)
        self.out = nn.Linear(16, 5)
        self.use_branch = True

    def forward(self, x):
        h = F.relu(self.a(x))
        if self.use_branch:
            h = h + self.sometimes(h)
        return self.out(h)


class Checkpointed(nn.Module):
    """`shared` runs twice, each time inside reentrant activation checkpointing, so its gradient
    accumulator fires twice per backward; `twice` is used twice in one forward."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(12, 16)
        self.shared = nn.Linear(16, 16)
        self.twice = nn.Linear(16, 16)
        self.out = nn.Linear(16, 5)

    def _block(self, h):
        return torch.tanh(self.shared(h))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = F.relu(self.a(x))
        h = checkpoint(self._block, h, use_reentrant=True)
        h = self.twice(F.relu(self.twice(h)))
        h = checkpoint(self._block, h, use_reentrant=True)
        return self.out(h)


MODELS = {"mlp": MLP, "cnn": CNN, "tied": Tied, "branchy": Branchy, "ckpt": Checkpointed}


def _batch(kind, rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    if kind == "cnn":
        return torch.randn(8, 1, 6, 6, generator=g), torch.randint(0, 5, (8,), generator=g)
    if kind == "tied":
        return torch.randint(0, 20, (8, 3), generator=g), torch.randint(0, 20, (8,), generator=g)
    return torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)


def _train(rank, ws, impl, kind, opts, steps, accumulate):
    import torchdist_ext

    torch.manual_seed(0)
    model = MODELS[kind]()
    cls = torchdist_ext.DistributedDataParallel if impl == "tdx" else torch.nn.parallel.DistributedDataParallel
    ddp = cls(model, **opts)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        opt.zero_grad(set_to_none=step % 2 == 1)  # both: gradients reduced in place, and fresh ones
        if kind == "branchy":
            model.use_branch = step % 2 == 0
        for micro in range(accumulate):
            x, y = _batch(kind, rank, step * 10 + micro)
            sync = micro == accumulate - 1
            ctx = ddp.no_sync() if not sync else torch.enable_grad()
            with ctx:
                F.cross_entropy(ddp(x), y).backward()
        opt.step()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return state, grads


CASES = [
    ("mlp", {"bucket_cap_mb": 0.002}, 1),
    ("cnn", {}, 1),
    ("tied", {"bucket_cap_mb": 0.001}, 1),
    ("branchy", {"find_unused_parameters": True}, 1),
    ("mlp", {"bucket_cap_mb": 0.002}, 3),  # no_sync accumulation
    ("mlp", {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.002}, 2),
    ("ckpt", {"static_graph": True, "bucket_cap_mb": 0.002}, 1),  # reentrant checkpointing
    ("ckpt", {"static_graph": True}, 1),
    ("tied", {"static_graph": True, "gradient_as_bucket_view": True, "bucket_cap_mb": 0.001}, 1),
]


def _all_cases(rank, ws):
    """Both implementations, every case, in the same processes (spawning is the slow part)."""
    return [(_train(rank, ws, "tdx", *case[:2], 5, case[2]), _train(rank, ws, "torch", *case[:2], 5, case[2]))
            for case in CASES]


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_matches_torch_ddp(ws):
    results = run_ranks(_all_cases, ws)
    for r in range(ws):
        for (kind, opts, _), (ours, ref) in zip(CASES, results[r]):
            for key in ref[0]:
                assert torch.equal(ours[0][key], ref[0][key]), f"{kind} {opts} rank {r}: {key} differs"
            assert set(ours[1]) == set(ref[1]), f"{kind}: different parameters have gradients"
            for key in ref[1]:
                assert torch.equal(ours[1][key], ref[1][key]), f"{kind} {opts} rank {r}: grad {key} differs"


def _unused_without_flag(rank, ws):
    import torchdist_ext

    ddp = torchdist_ext.DistributedDataParallel(Branchy())
    x, y = _batch("mlp", rank, 0)
    try:
        F.cross_entropy(ddp(x), y).backward()
    except RuntimeError as e:
        return str(e)
    raise AssertionError("an unused parameter without find_unused_parameters did not raise")


def test_unused_parameter_error_names_it():
    for msg in run_ranks(_unused_without_flag, 2):
        assert "unused.weight" in msg and "find_unused_parameters=True" in msg, msg


def _bucket_rebuild(rank, ws):
    import torchdist_ext

    torch.manual_seed(0)
    ddp = torchdist_ext.DistributedDataParallel(MLP(), bucket_cap_mb=0.002)
    before = ddp.bucket_indices()
    for step in range(2):
        x, y = _batch("mlp", rank, step)
        F.cross_entropy(ddp(x), y).backward()
    return before, ddp.bucket_indices(), ddp.reducer.rebuilt


def test_buckets_rebuilt_once_and_identical_on_every_rank():
    results = run_ranks(_bucket_rebuild, 3)
    for before, after, rebuilt in results:
        assert rebuilt
        assert sorted(i for b in after for i in b) == list(range(6))
        assert after == results[0][1]


def _direct_buckets(rank, ws):
    """On tdx, buckets are reduced in place in the gradients (PREMUL_SUM); with a comm hook, bucket
    views or another backend they go through the flat bucket."""
    import torchdist_ext
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    gloo = dist.new_group(backend="gloo")
    out = {}
    for name, opts, hook in [("tdx", {}, None), ("gloo", {"process_group": gloo}, None),
                             ("hook", {}, allreduce_hook), ("view", {"gradient_as_bucket_view": True}, None)]:
        torch.manual_seed(0)
        model = MLP()
        ddp = torchdist_ext.DistributedDataParallel(model, bucket_cap_mb=0.002, **opts)
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        x, y = _batch("mlp", rank, 0)
        F.cross_entropy(ddp(x), y).backward()
        grads = [p.grad for p in model.parameters()]
        # Separate tensors, as under torch's DDP without gradient_as_bucket_view.
        distinct = len({g.untyped_storage().data_ptr() for g in grads}) == len(grads)
        out[name] = (ddp.reducer.direct_buckets(), distinct, ddp.reducer.bucket_bytes_allocated())
    # An unused parameter's bucket needs its flat tensor (zeros stand in for the gradient); the
    # others still reduce in place. A small first bucket gives this little model several buckets.
    import torchdist_ext.ddp as ddp_module

    torch.manual_seed(0)
    model = Branchy()
    first, ddp_module._FIRST_BUCKET_BYTES = ddp_module._FIRST_BUCKET_BYTES, 1024
    try:
        ddp = torchdist_ext.DistributedDataParallel(model, find_unused_parameters=True, bucket_cap_mb=0.001)
    finally:
        ddp_module._FIRST_BUCKET_BYTES = first
    x, y = _batch("mlp", rank, 0)
    F.cross_entropy(ddp(x), y).backward()
    params = list(model.parameters())
    unused = {i for i, p in enumerate(params) if any(p is q for q in model.unused.parameters())}
    holding = [b for b in ddp.reducer.bucket_indices() if unused & set(b)]
    want = sum(params[i].numel() * params[i].element_size() for b in holding for i in b)
    out["unused"] = (ddp.reducer.direct_buckets(), ddp.reducer.bucket_bytes_allocated(), want,
                     sum(p.numel() * p.element_size() for p in params), model.unused.weight.grad is None)
    return out


def test_buckets_reduced_in_place_on_tdx_only():
    grad_bytes = sum(p.numel() * p.element_size() for p in MLP().parameters())
    for out in run_ranks(_direct_buckets, 2):
        assert out["tdx"][0] and all(out["tdx"][0]) and out["tdx"][1], out
        assert out["tdx"][2] == 0, out  # no flat bucket allocated: the gradients are reduced where they lie
        assert not any(out["gloo"][0]) and out["gloo"][1] and out["gloo"][2] == grad_bytes, out
        assert not any(out["hook"][0]) and not any(out["view"][0]), out
        assert out["hook"][2] == grad_bytes and out["view"][2] == grad_bytes, out
        # Only the buckets holding the unused parameters allocate, and the unused grads stay None.
        direct, allocated, want, total, untouched = out["unused"]
        assert all(direct) and allocated == want and 0 < allocated < total and untouched, out


def _shape_mismatch(rank, ws):
    import torchdist_ext

    model = nn.Linear(4, 3 + rank)
    try:
        torchdist_ext.DistributedDataParallel(model)
    except ValueError as e:
        return str(e)
    raise AssertionError("different shapes were accepted")


def test_different_shapes_refused():
    for msg in run_ranks(_shape_mismatch, 2):
        assert "different parameters" in msg, msg


def _checkpoint_without_static_graph(rank, ws):
    import torchdist_ext

    ddp = torchdist_ext.DistributedDataParallel(Checkpointed())
    x, y = _batch("mlp", rank, 0)
    try:
        F.cross_entropy(ddp(x), y).backward()
    except RuntimeError as e:
        return str(e)
    raise AssertionError("a parameter whose accumulator ran twice was accepted without static_graph")


def test_reentrant_checkpoint_without_static_graph_names_the_flag():
    for msg in run_ranks(_checkpoint_without_static_graph, 2):
        assert "shared.weight" in msg or "shared.bias" in msg, msg
        assert "static_graph=True" in msg, msg


# ---- join() with uneven inputs ---------------------------------------------------------------

def _train_uneven(rank, ws, impl, kind, opts, hook, divide=True):
    import torchdist_ext

    torch.manual_seed(0)
    model = MODELS[kind]()
    cls = torchdist_ext.DistributedDataParallel if impl == "tdx" else torch.nn.parallel.DistributedDataParallel
    ddp = cls(model, **opts)
    if hook:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    with ddp.join(divide_by_initial_world_size=divide):
        for step in range(2 + 2 * rank):  # rank r runs out after 2 + 2r batches
            opt.zero_grad(set_to_none=False)
            x, y = _batch(kind, rank, step)
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


JOIN_CASES = [("mlp", {"bucket_cap_mb": 0.002}, False), ("cnn", {}, False),
              ("branchy", {"find_unused_parameters": True}, False), ("mlp", {"bucket_cap_mb": 0.002}, True),
              # divide_by_initial_world_size=False: averaged over the ranks still training
              ("mlp", {"bucket_cap_mb": 0.002}, False, False), ("cnn", {}, False, False)]


def _join_all(rank, ws):
    return [(_train_uneven(rank, ws, "tdx", *c), _train_uneven(rank, ws, "torch", *c)) for c in JOIN_CASES]


@pytest.mark.parametrize("ws", [1, 2, 3])
def test_join_uneven_inputs_match_torch_ddp(ws):
    results = run_ranks(_join_all, ws, timeout=240)
    for r in range(ws):
        for case, (ours, ref) in zip(JOIN_CASES, results[r]):
            for key in ref:
                assert torch.equal(ours[key], ref[key]), f"join {case} ws={ws} rank {r}: {key} differs"
                assert torch.equal(ours[key], results[0][case_index(case)][0][key]), "ranks disagree after join"


def case_index(case):
    return JOIN_CASES.index(case)


def _join_throws(rank, ws):
    import torchdist_ext

    torch.manual_seed(0)
    ddp = torchdist_ext.DistributedDataParallel(MLP())
    try:
        with ddp.join(throw_on_early_termination=True):
            for step in range(1 + rank):
                x, y = _batch("mlp", rank, step)
                F.cross_entropy(ddp(x), y).backward()
    except RuntimeError as e:
        return str(e)
    return None


def test_join_throw_on_early_termination_raises_instead_of_hanging():
    msgs = run_ranks(_join_throws, 2, timeout=120)
    assert any(m and "exhausted" in m.lower() for m in msgs), msgs


def _bn_schedule(rank, ws, impl):
    """BatchNorm model: synchronized steps, no_sync() steps and no-grad forwards, interleaved."""
    import torchdist_ext

    torch.manual_seed(0)
    model = CNN()
    cls = torchdist_ext.DistributedDataParallel if impl == "tdx" else torch.nn.parallel.DistributedDataParallel
    ddp = cls(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    states = []
    # s: synchronized step, n: forward+backward under no_sync(), e: forward under no_grad.
    for step, kind in enumerate("snnsnsseensns"):
        x, y = _batch("cnn", rank, step)
        if kind == "e":
            with torch.no_grad():
                ddp(x)
        else:
            with ddp.no_sync() if kind == "n" else torch.enable_grad():
                F.cross_entropy(ddp(x), y).backward()
            if kind == "s":
                opt.step()
                opt.zero_grad()
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return states


def _bn_both(rank, ws):
    return _bn_schedule(rank, ws, "tdx"), _bn_schedule(rank, ws, "torch")


@pytest.mark.parametrize("ws", [2, 3])
def test_buffer_broadcast_follows_torch_ddp_with_no_sync(ws):
    """Parameters and BatchNorm buffers equal torch's DDP's after every step, on every rank."""
    for r, (ours, ref) in enumerate(run_ranks(_bn_both, ws)):
        for step, (a, b) in enumerate(zip(ours, ref)):
            for key in b:
                assert torch.equal(a[key], b[key]), f"rank {r}, step {step}: {key} differs from torch's DDP"
