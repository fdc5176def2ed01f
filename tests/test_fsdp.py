"""torchdist_ext.FullyShardedDataParallel (ZeRO stages 1/2/3): training matches single-process
training, memory follows the ZeRO formulas, no_sync, clip_grad_norm_, state dicts, wrapping,
mixed precision, sharded checkpoints across world sizes, clear errors. World sizes 1-4 over
models whose parameter counts the world sizes do not divide."""
import contextlib
import functools
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from _dist import run_ranks


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.gate = nn.Parameter(torch.full((1,), 0.5))

    def forward(self, x):
        return x + self.gate * torch.tanh(self.norm(self.fc(x)))


class Net(nn.Module):
    """7 -> 13 -> 13 -> 13 -> 5 with a buffer. Units: each Block 209 = 11 * 19 parameters, the rest
    179 (prime), all 597 = 3 * 199: no world size 2-4 divides every flat parameter."""

    def __init__(self, d=13, blocks=2):
        super().__init__()
        self.inp = nn.Linear(7, d)
        self.blocks = nn.Sequential(*[Block(d) for _ in range(blocks)])
        self.out = nn.Linear(d, 5)
        self.bias0 = nn.Parameter(torch.zeros(5))
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        return self.out(self.blocks(F.relu(self.inp(x)))) * self.scale + self.bias0


def _batch(rank, step, n=4):
    g = torch.Generator().manual_seed(7919 * step + rank)
    return torch.randn(n, 7, generator=g), torch.randint(0, 5, (n,), generator=g)


def _make_optim(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _reference(ws, optim, steps, clip=None, micro=1):
    """Single-process training on the concatenation of every rank's batches."""
    torch.manual_seed(0)
    model = Net()
    opt = _make_optim(optim, model.parameters())
    norms = []
    for step in range(steps):
        for m in range(micro):
            xs, ys = zip(*[_batch(r, step * micro + m) for r in range(ws)])
            loss = F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)) / micro
            loss.backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return model.state_dict(), norms


def _wrap(model, stage, wrap, **kw):
    import torchdist_ext
    from torchdist_ext.fsdp import size_based_auto_wrap_policy

    policy = None
    if wrap == "blocks":
        policy = torchdist_ext.ModuleWrapPolicy({Block})
    elif wrap == "size":
        policy = functools.partial(size_based_auto_wrap_policy, min_num_params=200)
    elif wrap == "nested":  # Linear units inside Block units inside the root
        policy = torchdist_ext.ModuleWrapPolicy({Block, nn.Linear})
    return torchdist_ext.FullyShardedDataParallel(model, stage=stage, auto_wrap_policy=policy, **kw)


def _train(rank, ws, stage, wrap, optim, steps, clip=None, micro=1, **kw):
    import torchdist_ext

    torch.manual_seed(0)
    model = _wrap(Net(), stage, wrap, **kw)
    opt = _make_optim(optim, model.parameters())
    norms = []
    for step in range(steps):
        for m in range(micro):
            x, y = _batch(rank, step * micro + m)
            ctx = model.no_sync() if m < micro - 1 else contextlib.nullcontext()
            with ctx:
                loss = F.cross_entropy(model(x), y) / micro
                loss.backward()
        if clip is not None:
            norms.append(float(model.clip_grad_norm_(clip)))
        opt.step()
        opt.zero_grad()
    return model, opt, torchdist_ext.full_state_dict(model), norms


def _close(sd, ref, what, atol=2e-5, rtol=1e-4):
    assert list(sd.keys()) == list(ref.keys()), f"{what}: keys {list(sd)} != {list(ref)}"
    for k in ref:
        torch.testing.assert_close(sd[k], ref[k], atol=atol, rtol=rtol, msg=lambda m: f"{what} {k}: {m}")


def _all_stages(rank, ws):
    failures = []
    for stage in (1, 2, 3):
        for wrap in ("none", "blocks", "size", "nested"):
            for optim in ("sgd", "adamw"):
                if wrap in ("size", "nested") and optim == "sgd":
                    continue
                _, _, sd, _ = _train(rank, ws, stage, wrap, optim, steps=3)
                if rank == 0:
                    ref, _ = _reference(ws, optim, 3)
                    # The full state dict loads into the plain module with the original keys.
                    plain = Net()
                    plain.load_state_dict(sd, strict=True)
                    try:
                        _close(sd, ref, f"stage {stage} wrap {wrap} {optim}")
                    except AssertionError as e:
                        failures.append(str(e))
                else:
                    assert sd == {}, "full_state_dict must be empty off rank 0"
    return failures


@pytest.mark.parametrize("ws", [1, 2, 3, 4])
def test_every_stage_matches_single_process_training(ws):
    failures = run_ranks(_all_stages, ws)[0]
    assert not failures, "\n".join(failures)


def _gloo_case(rank, ws):
    _, _, sd, _ = _train(rank, ws, 3, "blocks", "adamw", steps=2)
    _, _, sd2, _ = _train(rank, ws, 1, "none", "sgd", steps=2)
    if rank == 0:
        _close(sd, _reference(ws, "adamw", 2)[0], "gloo stage 3")
        _close(sd2, _reference(ws, "sgd", 2)[0], "gloo stage 1")
    return True


def test_works_over_gloo():
    assert all(run_ranks(_gloo_case, 2, backend="gloo"))


def _no_sync_case(rank, ws):
    import torchdist_ext.fsdp.flat_param as fp

    calls = []
    for name in ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single"):
        real = getattr(dist, name, None)
        if real is None:
            continue

        def counting(*a, _real=real, _name=name, **k):
            calls.append(_name)
            return _real(*a, **k)

        setattr(fp.dist, name, counting)
    results = {}
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = _wrap(Net(), stage, "blocks")
        opt = _make_optim("adamw", model.parameters())
        for step in range(2):
            for m in range(3):
                x, y = _batch(rank, step * 3 + m)
                before = len(calls)
                if m < 2:
                    with model.no_sync():
                        (F.cross_entropy(model(x), y) / 3).backward()
                    assert len(calls) == before, f"stage {stage}: no_sync backward communicated: {calls[before:]}"
                else:
                    (F.cross_entropy(model(x), y) / 3).backward()
                    assert len(calls) == before + len(model.units), \
                        f"stage {stage}: expected one reduction per unit, got {calls[before:]}"
            opt.step()
            opt.zero_grad()
        results[stage] = torchdist_ext_full(model)
    return results


def torchdist_ext_full(model):
    import torchdist_ext

    return torchdist_ext.full_state_dict(model)


def test_no_sync_accumulates_without_communication():
    results = run_ranks(_no_sync_case, 3)[0]
    ref, _ = _reference(3, "adamw", 2, micro=3)
    for stage, sd in results.items():
        _close(sd, ref, f"no_sync stage {stage}")


def _clip_case(rank, ws):
    out = {}
    for stage in (1, 3):
        _, _, sd, norms = _train(rank, ws, stage, "blocks", "sgd", steps=3, clip=0.05)
        out[stage] = (sd, norms)
    return out


def test_clip_grad_norm_uses_the_global_norm():
    results = run_ranks(_clip_case, 3)
    ref, ref_norms = _reference(3, "sgd", 3, clip=0.05)
    for stage in (1, 3):
        for rank in range(3):  # every rank sees the same global norm
            assert results[rank][stage][1] == pytest.approx(ref_norms, rel=1e-4), f"stage {stage} rank {rank}"
        _close(results[0][stage][0], ref, f"clipped stage {stage}")


def _memory_case(rank, ws):
    from torchdist_ext.fsdp import training_state_bytes

    out = {}
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = _wrap(Net(d=96, blocks=4), stage, "blocks")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x = torch.randn(4, 7)
        model(x).sum().backward()
        opt.step()
        out[stage] = training_state_bytes(model, opt)
    return out


@pytest.mark.parametrize("ws", [2, 3])
def test_memory_follows_zero_formulas(ws):
    results = run_ranks(_memory_case, ws)
    psi = sum(p.numel() for p in Net(d=96, blocks=4).parameters())  # fp32 parameters
    units = 5
    slack = units * ws * 4 * 4 + units * 8 + units * 4 * 4 * 4  # tail padding, step scalars, alignment gaps
    for rank, per_stage in enumerate(results):
        for stage, b in per_stage.items():
            what = f"stage {stage} rank {rank}: {b}"
            # AdamW: two fp32 states per parameter -> 8 bytes per owned parameter.
            assert 8 * psi / ws <= b["optimizer"] <= 8 * psi / ws + 2 * slack, what
            assert 4 * psi / ws <= b["grads"] <= 4 * psi / ws + slack, what  # gradient shards only at rest
            if stage == 3:
                assert 4 * psi / ws <= b["params"] <= 4 * psi / ws + slack, what
                assert b["total"] <= 1.1 * 16 * psi / ws, what  # the target
            else:  # full parameters stay; the shard is a view of them
                assert 4 * psi <= b["params"] <= 4 * psi + slack * ws, what


def _policy_case(rank, ws):
    import torchdist_ext

    counts = {}
    for wrap in ("none", "blocks", "size"):
        model = _wrap(Net(d=13, blocks=3), 3, wrap)
        counts[wrap] = [type(u.module).__name__ for u in model.units]
        assert len(list(model.parameters())) == len(model.units)
    # Nested: each Block a unit holding its LayerNorm and gate, its Linear a unit inside it; the
    # root keeps bias0.
    nested = _wrap(Net(d=13, blocks=3), 3, "nested")
    counts["nested"] = [type(u.module).__name__ for u in nested.units]
    # Torch's own policy objects follow the same protocol.
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy
    torch_policy = torchdist_ext.FullyShardedDataParallel(Net(d=13, blocks=3), auto_wrap_policy=TorchPolicy({Block}))
    counts["torch"] = [type(u.module).__name__ for u in torch_policy.units]
    return counts


def test_auto_wrap_policies_by_class_size_and_nested():
    counts = run_ranks(_policy_case, 2)[0]
    assert counts["none"] == ["Net"]
    assert counts["blocks"] == ["Block", "Block", "Block", "Net"]
    # Block holds 13*13+13+2*13+1 = 209 params >= 200 (its Linear alone 182); the root keeps the rest.
    assert counts["size"] == ["Block", "Block", "Block", "Net"]
    assert counts["nested"] == ["Linear", "Linear", "Block", "Linear", "Block", "Linear", "Block", "Linear", "Net"]
    assert counts["torch"] == ["Block", "Block", "Block", "Net"]


def _release_case(rank, ws, stage):
    torch.manual_seed(0)
    net = Net()
    names = [n for n, _ in net.named_parameters()]
    before = {k: v.clone() for k, v in net.state_dict().items()}
    model = _wrap(net, stage, "nested")
    x, _ = _batch(rank, 0)
    out = model(x).detach()  # forward: the parameters' attributes now hold views of the full buffers
    flats = []
    for u in model.units:
        flats.append(torch.empty(u.layout.padded_numel))
        dist.all_gather_into_tensor(flats[-1], u.shard.detach().contiguous())
    assert model.release(flats) is net
    assert [n for n, _ in net.named_parameters()] == names  # the original order, no flat shard left
    assert all(torch.equal(net.state_dict()[k], v) for k, v in before.items())
    again = _wrap(net, stage, "nested")
    return torch.equal(again(x), out)


@pytest.mark.parametrize("stage", [1, 3])
def test_release_gives_the_module_back_and_it_can_be_wrapped_again(stage):
    assert run_ranks(_release_case, 2, stage) == [True, True]


def _mixed_case(rank, ws):
    import torchdist_ext

    seen = []
    torch.manual_seed(0)
    net = Net()
    net.inp.register_forward_pre_hook(lambda m, a: seen.append((m.weight.dtype, a[0].dtype)))
    mp = torchdist_ext.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                      buffer_dtype=torch.bfloat16)
    model = torchdist_ext.FullyShardedDataParallel(net, stage=3, auto_wrap_policy=torchdist_ext.ModuleWrapPolicy({Block}),
                                                   mixed_precision=mp, cpu_offload=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    for step in range(3):
        x, y = _batch(rank, step)
        F.cross_entropy(model(x).float(), y).backward()
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
        opt.step()
        opt.zero_grad()
    assert net.scale.dtype == torch.bfloat16
    return seen, torchdist_ext.full_state_dict(model)


def test_mixed_precision_computes_low_keeps_fp32_masters():
    results = run_ranks(_mixed_case, 2)
    seen, sd = results[0]
    assert seen and all(w == torch.bfloat16 and a == torch.bfloat16 for w, a in seen), seen
    assert all(v.dtype == torch.float32 for v in sd.values()), "full_state_dict gives the original dtypes"
    ref, _ = _reference(2, "adamw", 3)
    _close(sd, ref, "bf16 compute vs fp32 reference", atol=2e-2, rtol=5e-2)


def _save(rank, ws, path, steps):
    import torchdist_ext

    model, opt, _, _ = _train(rank, ws, 3, "blocks", "adamw", steps=steps)
    torchdist_ext.save_sharded_checkpoint(model, path, optimizer=opt)
    return sorted(os.listdir(path))


def _resume(rank, ws, path, first_step, steps, save_to):
    import torchdist_ext

    torch.manual_seed(1)  # different init: everything must come from the checkpoint
    model = _wrap(Net(), 3, "blocks")
    opt = _make_optim("adamw", model.parameters())
    torchdist_ext.load_sharded_checkpoint(model, path, optimizer=opt)
    for step in range(first_step, first_step + steps):
        x, y = _batch(rank, step)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    if save_to:
        torchdist_ext.save_sharded_checkpoint(model, save_to, optimizer=opt)
    return torchdist_ext.full_state_dict(model)


def _reference_varying(plan, optim="adamw"):
    """Single process; the global batch of each step is the concatenation over that step's ranks."""
    torch.manual_seed(0)
    model = Net()
    opt = _make_optim(optim, model.parameters())
    step = 0
    for ws, steps in plan:
        for _ in range(steps):
            xs, ys = zip(*[_batch(r, step) for r in range(ws)])
            F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
            opt.step()
            opt.zero_grad()
            step += 1
    return model.state_dict()


def test_sharded_checkpoint_reshards_4_to_2_to_3_with_optimizer_state(tmp_path):
    a, b = str(tmp_path / "ws4"), str(tmp_path / "ws2")
    files = run_ranks(_save, 4, a, 2)[0]
    assert files == ["manifest.json"] + [f"shard-0000{r}-of-00004.pt" for r in range(4)], files
    run_ranks(_resume, 2, a, 2, 2, b)
    sd = run_ranks(_resume, 3, b, 4, 2, None)[0]
    _close(sd, _reference_varying([(4, 2), (2, 2), (3, 2)]), "4 -> 2 -> 3")


def _error_cases(rank, ws, path):
    import torchdist_ext

    errors = {}

    def expect(key, exc, fn):
        try:
            fn()
        except exc as e:
            errors[key] = str(e)
        else:
            errors[key] = None

    class SharedAcross(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = Block(5)
            self.b = Block(5)
            self.b.fc.weight = self.a.fc.weight

        def forward(self, x):
            return self.b(self.a(x))

    expect("shared", ValueError, lambda: torchdist_ext.FullyShardedDataParallel(
        SharedAcross(), auto_wrap_policy=torchdist_ext.ModuleWrapPolicy({Block})))
    frozen = Net()
    frozen.inp.weight.requires_grad_(False)
    expect("frozen", ValueError, lambda: torchdist_ext.FullyShardedDataParallel(frozen))
    expect("stage", ValueError, lambda: torchdist_ext.FullyShardedDataParallel(Net(), stage=4))
    # Frozen modules in units of their own are fine.
    ok = Net()
    for p in ok.blocks[0].parameters():
        p.requires_grad_(False)
    m = torchdist_ext.FullyShardedDataParallel(ok, auto_wrap_policy=torchdist_ext.ModuleWrapPolicy({Block}))
    m(torch.randn(2, 7)).sum().backward()
    model = _wrap(Net(), 3, "blocks")
    torchdist_ext.save_sharded_checkpoint(model, path)
    other = _wrap(Net(), 3, "none")
    expect("units", ValueError, lambda: torchdist_ext.load_sharded_checkpoint(other, path))
    dist.barrier()
    if rank == 0:
        os.remove(os.path.join(path, "shard-00001-of-00002.pt"))
    dist.barrier()
    expect("missing", ValueError, lambda: torchdist_ext.load_sharded_checkpoint(_wrap(Net(), 3, "blocks"), path))
    return errors


def test_bad_configurations_get_clear_errors(tmp_path):
    errors = run_ranks(_error_cases, 2, str(tmp_path / "ck"))[0]
    assert "'a.fc.weight'" in errors["shared"] and "different wrapped units" in errors["shared"], errors["shared"]
    assert "frozen parameters ['inp.weight']" in errors["frozen"], errors["frozen"]
    assert "stage=4" in errors["stage"], errors["stage"]
    assert "wrapped units" in errors["units"], errors["units"]
    assert "shard-00001-of-00002.pt" in errors["missing"] and "cannot be mapped" in errors["missing"], errors["missing"]
