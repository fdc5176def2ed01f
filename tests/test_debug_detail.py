"""tdx under torch's own debug switch, TORCH_DISTRIBUTED_DEBUG=DETAIL (issue 20).

Under DETAIL torch wraps every backend in its ProcessGroupWrapper, which reads the group's sequence
number and checks each collective's shape against the other ranks' before running it.
"""
import torch
import torch.distributed as dist

from _dist import run_ranks

DETAIL = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}


def _subgroups_body(rank, ws):
    assert dist.get_debug_level() == dist.DebugLevel.DETAIL, "the variable must reach torch at import"
    pair = dist.new_group([0, 1])
    odd = dist.new_group([r for r in range(ws) if r % 2 == 1])
    out = {}
    if rank in (0, 1):
        t = torch.full((3,), float(rank + 1))
        dist.all_reduce(t, group=pair)
        b = torch.arange(4.0) if rank == 1 else torch.zeros(4)
        dist.broadcast(b, src=1, group=pair)
        out["pair"] = (t, b)
        backend = pair._get_backend(torch.device("cpu"))
        out["pair_seq"] = backend._get_sequence_number_for_group()
    if rank % 2 == 1:
        gathered = [torch.empty(2) for _ in range(dist.get_world_size(odd))]
        dist.all_gather(gathered, torch.full((2,), float(rank)), group=odd)
        out["odd"] = torch.stack(gathered)
    t = torch.ones(2)
    dist.all_reduce(t)
    out["world"] = t
    return out


def test_detail_with_subgroups():
    ws = 3
    results = run_ranks(_subgroups_body, ws, env=DETAIL)
    for rank, res in enumerate(results):
        assert torch.equal(res["world"], torch.full((2,), float(ws)))
        if rank in (0, 1):
            t, b = res["pair"]
            assert torch.equal(t, torch.full((3,), 3.0))
            assert torch.equal(b, torch.arange(4.0))
        if rank % 2 == 1:
            assert torch.equal(res["odd"], torch.ones(1, 2))
    # Both ranks of the pair ran the same collectives, so their sequence numbers agree.
    assert results[0]["pair_seq"] == results[1]["pair_seq"] > 0
