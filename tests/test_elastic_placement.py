"""Replica placement: across hosts a rank's in-memory replica lives on another host than the rank.

The ring itself as a table (one host: ranks in order; hosts of equal and unequal sizes: no two
ring neighbours on one host unless a host holds more than half of the ranks). On 2 simulated hosts
x 2 ranks (TDX_NODE_ID): ElasticFSDP's replicas sit on the other host and equal their source's
shards and Adam state after every step; ElasticPipeline with the last stage SIGKILLed rebuilds it
from its replica on the other host and finishes on 3 ranks, bit for bit equal to one process
training the unsplit model (a pipeline moves activations and gradients without reductions, so
hosts change no rounding)."""
import pytest
import torch

from _dist import run_ranks
from _elastic_runs import assert_replica_equals, survivors_of
from torchdist_ext.elastic._placement import Ring, replica_ring


def _same_host_neighbours(nodes, ring):
    return sum(nodes[a] == nodes[b] for a, b in zip(ring, ring[1:] + ring[:1]))


@pytest.mark.parametrize("nodes,ring", [
    (["a"] * 4, [0, 1, 2, 3]),
    (["a", "a", "b", "b"], [0, 2, 1, 3]),
    (["a", "a", "b", "b", "c", "c"], [0, 3, 1, 4, 2, 5]),
    (["b", "a", "b", "a"], [0, 1, 2, 3]),
    (["a", "a", "a", "b", "b", "c"], [0, 3, 1, 4, 2, 5]),
])
def test_replica_ring_puts_ring_neighbours_on_different_hosts(nodes, ring):
    got = replica_ring(nodes)
    assert got == ring, got
    if len(set(nodes)) > 1:
        assert _same_host_neighbours(nodes, got) == 0, got
        r = Ring(got)
        assert all(nodes[r.holder(x)] != nodes[x] and nodes[r.source(x)] != nodes[x] for x in range(len(nodes)))


def test_replica_ring_with_a_host_holding_more_than_half_alternates_where_it_can():
    nodes = ["a", "a", "a", "b"]
    got = replica_ring(nodes)
    assert sorted(got) == [0, 1, 2, 3]
    assert _same_host_neighbours(nodes, got) == 2, got  # 3 of 4 on one host: 2 adjacencies cannot be avoided


def test_ring_refuses_what_is_not_a_permutation():
    with pytest.raises(ValueError, match=r"not a permutation of the group ranks 0..2"):
        Ring([0, 0, 2])


def _two_hosts(rank):
    """Ranks 0-1 on simulated host A, 2-3 on host B (tdx's multi-host mode: Gloo between them)."""
    return {"TDX_NODE_ID": f"simhost{rank // 2}"}


def _fsdp_body(rank, ws):
    from test_elastic_fsdp import _replica_run

    trainer, seen = _replica_run(rank, ws, 3)
    return trainer.ring.order, trainer.replica.source, trainer.replica.holder, seen


def test_fsdp_replicas_live_on_the_other_host_and_follow_their_source():
    out = run_ranks(_fsdp_body, 4, timeout=240, rank_env=_two_hosts)
    host = [r // 2 for r in range(4)]
    rings = {tuple(out[r][0]) for r in range(4)}
    assert rings == {(0, 2, 1, 3)}, rings
    for r in range(4):
        _, source, holder, seen = out[r]
        assert host[source] != host[r] and host[holder] != host[r], (r, source, holder)
        assert out[source][2] == r, f"rank {source}'s holder is {out[source][2]}, not rank {r}"
        for step, (_, replica) in enumerate(seen):
            assert_replica_equals(replica, out[source][3][step][0],
                                  f"step {step}: rank {r}'s replica of rank {source}'s shards (one per unit)")


def _pipeline_body(rank, ws, victim):
    from test_elastic_pipeline import _kill_body

    from torchdist_ext.elastic import ElasticPipeline

    held = {}
    init = ElasticPipeline.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        held.update(ring=list(self.ring.order), source=self.replica.source)

    ElasticPipeline.__init__ = record
    try:
        params, ref, recoveries = _kill_body(rank, ws, victim, "1f1b")
    finally:
        ElasticPipeline.__init__ = init
    return params, ref, recoveries, held


def test_pipeline_last_stage_killed_is_rebuilt_from_its_replica_on_the_other_host_bit_for_bit():
    """Stage 3 (hostB) dies before step 3 of 6; its replica was on rank 1 (hostA), not on rank 2,
    its host mate (the old placement)."""
    from test_elastic_pipeline import KILL_STEP

    victim = 3
    out = run_ranks(_pipeline_body, 4, victim, pg_timeout=60.0, expect_failure_ranks=True, timeout=300,
                    rank_env=_two_hosts)
    survivors = survivors_of(out, [victim])
    held = {r: out[r][1][3] for r in survivors}
    assert all(h["ring"] == [0, 2, 1, 3] for h in held.values()), held
    assert held[1]["source"] == victim, held  # the dead stage's replica lived on hostA
    ref = next(out[r][1][1] for r in survivors if out[r][1][1] is not None)
    merged = {}
    for r in survivors:
        merged.update(out[r][1][0])
    assert sorted(merged) == sorted(ref)
    for name, want in ref.items():
        assert torch.equal(merged[name], want), f"{name} differs from the reference"
    recoveries = out[survivors[0]][1][2]
    assert [x["step"] for x in recoveries] == [KILL_STEP] and f"rank {victim} (pid" in recoveries[0]["excluded"][0]
