"""What every elastic trainer shares: the step loop that retries a failed step, and the recovery
skeleton (gone ranks, shrink, same-step check, sampler re-split, the record of each recovery).
ElasticDDP (_ddp.py), ElasticFSDP (_fsdp.py) and ElasticPipeline (_pipeline.py) fill in what is theirs: the attempt, the commit
and the rebuild for the new world size."""
import math
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from . import _liveness
from ._group import SHRINK_ABORT, RankExcludedError, _tdx_backend, gone_ranks, note_progress, shrink_group, watch_stuck
from ._group import excluded as excluded_why


def resplit_sampler(sampler, rank, world_size):
    """Points a ``DistributedSampler`` at ``rank`` of ``world_size`` ranks from its next epoch on
    (the epoch being iterated keeps its indices)."""
    sampler.rank, sampler.num_replicas = rank, world_size
    n = len(sampler.dataset)
    if sampler.drop_last and n % world_size:
        sampler.num_samples = math.ceil((n - world_size) / world_size)
    else:
        sampler.num_samples = math.ceil(n / world_size)
    sampler.total_size = sampler.num_samples * world_size


def repoint_optimizer(optimizer, params_per_group, states):
    """Points ``optimizer``'s parameter groups at new parameters (one list per group; the groups'
    hyper-parameters stay) with their optimizer state ``{parameter: state}``: the same object goes
    on, so LR schedulers keep working."""
    if len(params_per_group) != len(optimizer.param_groups):
        raise ValueError(f"torchdist_ext.elastic: optimizer_fn made {len(params_per_group)} parameter groups for the "
                         f"rebuilt parameters but the optimizer has {len(optimizer.param_groups)}; it must make the "
                         "same groups whatever parameters it is given")
    for group, params in zip(optimizer.param_groups, params_per_group):
        group["params"] = list(params)
    optimizer.state = defaultdict(dict)
    for params in params_per_group:
        for p in params:
            if states.get(p):
                optimizer.state[p] = states[p]


class ElasticTrainer:
    """Base of the elastic trainers. Subclasses implement:

    - ``_attempt(*what)`` (what ``step`` passes to ``_retrying``; ``(loss_fn, args, kwargs)`` by
      default): everything of a step that may fail because a peer died (zero_grad, forward,
      backward, whatever exchange must finish before the optimizer may step); returns the loss;
    - ``_commit()``: the optimizer step (runs only after an attempt that every rank finished);
    - ``_before_shrink()``: detach what still hooks into the old group (optional);
    - ``_rebuild(excluded, old_world_size)``: the wrapper (and whatever state) over the new group;
    - ``_check_recoverable(gone, error)``: raise when the survivors cannot recover (optional).
    """

    def __init__(self, process_group, sampler, max_recoveries):
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.sampler = sampler
        self.max_recoveries = max_recoveries
        self.steps_done = 0
        self.recoveries = []
        # Original group rank of every current member (the ranks of the group this trainer started on).
        self.members = list(range(dist.get_world_size(self.process_group)))
        _tdx_backend(self.process_group)  # refuses a group that is not on tdx, now
        _liveness.start(self.process_group)  # with the store in etcd: a lost host's ranks can be told
        self._watching = None  # the group the stuck-rank watch is armed on (from the first step on)

    @property
    def rank(self):
        return dist.get_rank(self.process_group)

    @property
    def world_size(self):
        return dist.get_world_size(self.process_group)

    def step(self, loss_fn, *args, **kwargs):
        """One training step, retried on the survivors when a peer fails; returns the loss (detached)."""
        return self._retrying(loss_fn, args, kwargs)

    def _retrying(self, *what):
        """``_attempt(*what)`` until it completes on the survivors, then ``_commit()``; returns the
        attempt's loss, detached (None where the attempt has none)."""
        while True:
            if self._watching is not self.process_group:  # from the first step (construction may import
                watch_stuck(self.process_group)  # for seconds) and after each recovery: stuck ranks
                self._watching = _liveness.watching = self.process_group
            try:
                loss = self._attempt(*what)
            except RuntimeError as error:
                self._recover(error)
                continue
            self._commit()
            self.steps_done += 1
            note_progress()
            return None if loss is None else loss.detach()

    def _attempt(self, loss_fn, args, kwargs):
        raise NotImplementedError

    def _commit(self):
        raise NotImplementedError

    def _before_shrink(self):
        pass

    def _rebuild(self, excluded, old_world_size):
        raise NotImplementedError

    def _check_recoverable(self, gone, error):
        pass

    def _recover(self, error):
        started = time.perf_counter()
        why = excluded_why(self.process_group)
        if why:  # this rank was stuck (or left out) and the others went on: it must not rejoin them here
            raise RankExcludedError(f"torchdist_ext.elastic: {why}. The other ranks went on without it "
                                    "(see trainer.recoveries there); this process can take no further part "
                                    "and must exit. Restart it to rejoin, or raise TDX_FAILURE_DETECTION_S "
                                    "if pauses that long are expected") from error
        # A recovery is not watched (its rebuild may take a while on one rank): the new group inherits
        # the disarmed watch; the next step arms it again.
        watch_stuck(self.process_group, 0)
        self._watching = _liveness.watching = None
        gone = gone_ranks(self.process_group)
        if not gone or (self.max_recoveries is not None and len(self.recoveries) >= self.max_recoveries):
            raise error
        self._check_recoverable(gone, error)
        _liveness.revoke(self.process_group, gone)  # with etcd: the excluded ranks' store writes fail from now
        # The failed step's graph and the old wrapper's hooks must not reach the retry.
        error.__traceback__ = None
        self._before_shrink()
        excluded = sorted(gone)
        old_world_size = self.world_size
        group = shrink_group(excluded, self.process_group, SHRINK_ABORT)
        self.members = [m for i, m in enumerate(self.members) if i not in gone]
        self.process_group = group
        self._check_same_step()
        self._rebuild(excluded, old_world_size)
        if self.sampler is not None:
            resplit_sampler(self.sampler, self.rank, self.world_size)
        self.recoveries.append({"step": self.steps_done, "excluded": [f"rank {r}: {why}" for r, why in gone.items()],
                                "world_size": self.world_size, "seconds": time.perf_counter() - started})

    def _check_same_step(self):
        t = torch.tensor([self.steps_done, -self.steps_done], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
        if int(t[0]) != -int(t[1]):
            raise RuntimeError(f"torchdist_ext.elastic: the survivors disagree on the last completed step (from "
                               f"{-int(t[1])} to {int(t[0])}; this rank: {self.steps_done}); some stepped the "
                               "optimizer before the failure reached them, so they cannot continue together")
