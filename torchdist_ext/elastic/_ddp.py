"""A training step that survives the death of peers: DDP over a group that shrinks in place."""
import math
import time

import torch
import torch.distributed as dist

from ..ddp import DistributedDataParallel
from ._group import SHRINK_ABORT, _tdx_backend, gone_ranks, shrink_group


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


class ElasticDDP:
    """Our ``DistributedDataParallel`` plus recovery: when a peer dies during a step, the survivors
    shrink the process group in place, rebuild DDP's reducer for the new world size, re-split the
    sampler and retry the step, losing at most that one step. No restart, no disk read.

    Args:
        module: the model (every rank the same, as for DDP).
        optimizer: the optimizer over ``module``'s parameters; it steps only after a backward whose
            gradients every surviving rank reduced, so a retried step never steps twice.
        process_group: a tdx group, on one host or spanning hosts (default: the default group).
        sampler: an optional ``DistributedSampler`` re-split over the survivors after a failure
            (from its next epoch: the current epoch's batches of the dead rank are lost).
        max_recoveries: how many failures to survive before re-raising (None: as many as ranks
            allow).
        **ddp_kwargs: passed to ``DistributedDataParallel`` (and again when it is rebuilt).

    ``step(loss_fn, *args)`` runs zero_grad, ``loss = loss_fn(model, *args)``, ``loss.backward()``
    and ``optimizer.step()``. ``recoveries`` lists what each recovery did and how long it took.
    """

    def __init__(self, module, optimizer, process_group=None, sampler=None, max_recoveries=None, **ddp_kwargs):
        self.module = module
        self.optimizer = optimizer
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.sampler = sampler
        self.max_recoveries = max_recoveries
        self._ddp_kwargs = ddp_kwargs
        self.steps_done = 0
        self.recoveries = []
        # Original group rank of every current member (the ranks of the group this trainer started on).
        self.members = list(range(dist.get_world_size(self.process_group)))
        _tdx_backend(self.process_group)  # refuses a group that is not on tdx, now
        self.model = DistributedDataParallel(module, process_group=self.process_group, **ddp_kwargs)

    @property
    def rank(self):
        return dist.get_rank(self.process_group)

    @property
    def world_size(self):
        return dist.get_world_size(self.process_group)

    def step(self, loss_fn, *args, **kwargs):
        """One training step, retried on the survivors when a peer fails; returns the loss (detached)."""
        while True:
            try:
                self.optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(self.model, *args, **kwargs)
                loss.backward()
            except RuntimeError as error:
                self._recover(error)
                continue
            self.optimizer.step()
            self.steps_done += 1
            return loss.detach()

    def _recover(self, error):
        started = time.perf_counter()
        gone = gone_ranks(self.process_group)
        if not gone or (self.max_recoveries is not None and len(self.recoveries) >= self.max_recoveries):
            raise error
        # The failed step's graph and the old reducer's hooks must not reach the retry.
        error.__traceback__ = None
        self.model.reducer.remove_hooks()
        excluded = sorted(gone)
        group = shrink_group(excluded, self.process_group, SHRINK_ABORT)
        self.members = [m for i, m in enumerate(self.members) if i not in gone]
        self.process_group = group
        self._check_same_step()
        self.model = DistributedDataParallel(self.module, process_group=group, **self._ddp_kwargs)
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
