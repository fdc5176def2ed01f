"""torchdist_ext.load_full_state_dict: a plain module's state dict loads into a sharded model of
every stage, at world sizes 1-4 (none divides the flat parameters), from every rank or from rank
0 only, and comes back bit for bit; bad dicts get a ValueError naming the keys on every rank."""
import torch

from _dist import run_ranks
from test_fsdp import Net, _wrap


def _plain():
    torch.manual_seed(123)  # different values from the seed-0 model that gets wrapped
    plain = Net()
    plain.scale.fill_(0.75)
    return plain


def _round_trip(rank, ws):
    import torchdist_ext

    plain = _plain()
    sd = plain.state_dict()
    x = torch.randn(3, 7, generator=torch.Generator().manual_seed(5))
    expected = plain(x)
    failures = []
    for stage in (1, 2, 3):
        for wrap in ("none", "nested"):
            for from_rank0 in (False, True):
                what = f"stage {stage} wrap {wrap} broadcast_from_rank0={from_rank0}"
                torch.manual_seed(0)
                model = _wrap(Net(), stage, wrap)
                model(x).sum().backward()  # gathered and reduced once: the load must refresh everything
                given = sd if (rank == 0 or not from_rank0) else None
                keys = torchdist_ext.load_full_state_dict(model, given, broadcast_from_rank0=from_rank0)
                if keys.missing_keys or keys.unexpected_keys:
                    failures.append(f"{what}: reported {keys}")
                with torch.no_grad():
                    out = model(x)
                if not torch.equal(out, expected):
                    failures.append(f"{what}: forward differs by {(out - expected).abs().max()}")
                back = torchdist_ext.full_state_dict(model)
                if rank == 0:
                    if list(back) != list(sd):
                        failures.append(f"{what}: keys {list(back)} != {list(sd)}")
                    failures += [f"{what}: {k} differs" for k in sd if not torch.equal(back[k], sd[k])]
    return failures


def test_full_state_dict_loads_at_every_world_size_and_stage():
    for ws in (1, 2, 3, 4):
        failures = [f for per_rank in run_ranks(_round_trip, ws) for f in per_rank]
        assert not failures, f"world size {ws}:\n" + "\n".join(failures)


def _bad_dicts(rank, ws):
    import torchdist_ext

    errors = {}
    sd = _plain().state_dict()

    def attempt(key, given, **kw):
        model = _wrap(Net(), 3, "nested")
        try:
            errors[key] = torchdist_ext.load_full_state_dict(model, given, **kw)
        except ValueError as e:
            errors[key] = str(e)

    missing = {k: v for k, v in sd.items() if k != "blocks.0.fc.weight"}
    attempt("missing", missing)
    attempt("unexpected", {**sd, "extra.weight": torch.zeros(2)})
    attempt("shape", {**sd, "out.bias": torch.zeros(6)})
    # Only rank 0's dict is read with broadcast_from_rank0; its problem reaches every rank.
    attempt("rank0", missing if rank == 0 else None, broadcast_from_rank0=True)
    # A dict that is wrong on one rank only: every rank raises, naming that rank.
    attempt("one_rank", missing if rank == 1 else sd)
    # strict=False loads what matches and reports the rest, as nn.Module.load_state_dict.
    torch.manual_seed(0)
    model = _wrap(Net(), 2, "blocks")
    before = torchdist_ext.full_state_dict(model, rank0_only=False)
    keys = torchdist_ext.load_full_state_dict(model, {**missing, "extra.weight": torch.zeros(2)}, strict=False)
    after = torchdist_ext.full_state_dict(model, rank0_only=False)
    errors["strict_false"] = (keys.missing_keys, keys.unexpected_keys,
                              torch.equal(after["blocks.0.fc.weight"], before["blocks.0.fc.weight"]),
                              all(torch.equal(after[k], sd[k]) for k in missing))
    return errors


def test_bad_state_dicts_raise_on_every_rank_naming_the_keys():
    results = run_ranks(_bad_dicts, 2)
    for rank, errors in enumerate(results):
        assert "missing keys ['blocks.0.fc.weight']" in errors["missing"], errors["missing"]
        assert "unexpected keys ['extra.weight']" in errors["unexpected"], errors["unexpected"]
        assert "out.bias: state dict [6] vs model [5]" in errors["shape"], errors["shape"]
        assert "rank 0's state dict" in errors["rank0"] and "blocks.0.fc.weight" in errors["rank0"], errors["rank0"]
        assert "rank 1: missing keys ['blocks.0.fc.weight']" in errors["one_rank"], errors["one_rank"]
        assert errors["strict_false"] == (["blocks.0.fc.weight"], ["extra.weight"], True, True), \
            f"rank {rank}: {errors['strict_false']}"
