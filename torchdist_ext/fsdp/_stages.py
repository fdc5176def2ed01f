"""The three ZeRO stages as policies over one sharding core.

Every stage keeps each wrapped unit's parameters as one padded flat buffer whose per-rank shard is
the fp32 master parameter the optimizer steps. The stages differ only in these switches.
"""
import dataclasses

__all__ = ["StagePolicy", "stage_policy"]


@dataclasses.dataclass(frozen=True)
class StagePolicy:
    """What one ZeRO stage does with a unit's flat parameter."""

    stage: int
    """1, 2 or 3 (ZeRO naming)."""
    reduce_scatter_grads: bool
    """True: gradients are reduce-scattered straight to their shard (stages 2 and 3); False: they
    are all-reduced and each rank keeps its slice (stage 1)."""
    shard_params_at_rest: bool
    """True: the full parameters are freed after each unit's forward and backward and all-gathered
    just before the next use (stage 3); False: they stay allocated and are all-gathered once after
    each optimizer step (stages 1 and 2)."""


_POLICIES = {
    1: StagePolicy(1, reduce_scatter_grads=False, shard_params_at_rest=False),
    2: StagePolicy(2, reduce_scatter_grads=True, shard_params_at_rest=False),
    3: StagePolicy(3, reduce_scatter_grads=True, shard_params_at_rest=True),
}


def stage_policy(stage):
    """The policy of ZeRO stage ``stage`` (1, 2 or 3); ValueError for anything else."""
    if isinstance(stage, bool) or stage not in _POLICIES:
        raise ValueError(f"FullyShardedDataParallel: stage={stage!r} is not a ZeRO stage; use 1 (optimizer state "
                         "sharded), 2 (also gradients) or 3 (also parameters)")
    return _POLICIES[stage]
