"""Keep training when a rank dies: the survivors shrink their tdx group in place and retry the step.

- ``gone_ranks(group)``: which ranks of a tdx group exited or announced that they are failing
  (with the store in etcd, also the ranks of a lost host, whose liveness leases expired);
- ``shrink_group(ranks_to_exclude, group, shrink_flags)``: ``torch.distributed.shrink_group`` on tdx
  (the survivors form a new group over shared memory, without the store);
- ``ElasticDDP``: our DDP with a ``step`` that shrinks, rebuilds the reducer, re-splits the
  sampler and retries the failed step;
- ``ElasticFSDP``: our FSDP / ZeRO (stages 1-3) with in-memory neighbour replicas of the shards and
  optimizer state, rebuilt and re-sharded over the survivors before the step is retried;
- ``ElasticPipeline``: pipeline parallelism (an ``nn.Sequential``, one stage per rank, GPipe or
  1F1B) with an in-memory replica of the next stage; after a failure the model is reassembled and
  re-split over the survivors;
- ``watch_stuck(group)`` / ``note_progress()`` / ``excluded(group)`` / ``RankExcludedError``: a rank alive but making no
  progress for ``TDX_FAILURE_DETECTION_S`` is excluded like a dead one, and fenced (its next call on
  the old group fails saying so);
- ``resplit_sampler``: a ``DistributedSampler`` over a new world size;
- ``rejoin(store)`` / ``joined()``: a restarted rank joins the running job (its trainers built with
  ``rejoin=True`` admit it at a step boundary); ``init_distributed`` does it by itself with
  ``TDX_STORE``.

See docs/elastic.md for what survives, what does not, and the costs.
"""
from ._ddp import ElasticDDP
from ._fsdp import ElasticFSDP
from ._pipeline import ElasticPipeline
from ._group import (SHRINK_ABORT, SHRINK_DEFAULT, RankExcludedError, excluded, gone_ranks, note_progress, shrink_group,
                     watch_stuck)
from ._rejoin import joined, rejoin
from ._trainer import resplit_sampler

__all__ = ["ElasticDDP", "ElasticFSDP", "ElasticPipeline", "RankExcludedError", "SHRINK_ABORT", "SHRINK_DEFAULT",
           "excluded", "gone_ranks", "joined", "note_progress", "rejoin", "resplit_sampler", "shrink_group",
           "watch_stuck"]
