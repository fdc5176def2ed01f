"""A training step that survives the death of peers: DDP over a group that shrinks in place."""
import torch.distributed as dist

from ..ddp import DistributedDataParallel
from ._trainer import ElasticTrainer

__all__ = ["ElasticDDP"]


class ElasticDDP(ElasticTrainer):
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
        rejoin: admit restarted ranks (``torchdist_ext.elastic.rejoin`` in the restarted process)
            at a step boundary: the group is re-formed at the larger size, and the joiner gets the
            parameters, optimizer state and step from rank 0 over the new group. Needs the default
            group and a store that outlives any rank (``file://`` rendezvous, ``TDX_STORE`` etcd).
        rejoin_every: check for a joiner every that many steps (one 8-byte broadcast per check).
        **ddp_kwargs: passed to ``DistributedDataParallel`` (and again when it is rebuilt).

    ``step(loss_fn, *args)`` runs zero_grad, ``loss = loss_fn(model, *args)``, ``loss.backward()``
    and ``optimizer.step()``. ``recoveries`` lists what each recovery did and how long it took.
    """

    def __init__(self, module, optimizer, process_group=None, sampler=None, max_recoveries=None, rejoin=False,
                 rejoin_every=1, **ddp_kwargs):
        self.module = module
        self.optimizer = optimizer
        self._ddp_kwargs = ddp_kwargs
        super().__init__(process_group, sampler, max_recoveries, rejoin, rejoin_every)
        if self._joining is not None:
            self._share_state()
        else:
            self.model = DistributedDataParallel(module, process_group=self.process_group, **ddp_kwargs)

    def _attempt(self, loss_fn, args, kwargs):
        self.optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(self.model, *args, **kwargs)
        loss.backward()
        return loss

    def _commit(self):
        self.optimizer.step()

    def _before_shrink(self):
        self.model.reducer.remove_hooks()

    def _rebuild(self, excluded, old_world_size):
        self.model = DistributedDataParallel(self.module, process_group=self.process_group, **self._ddp_kwargs)

    def _catch_up(self, src, behind, why):
        # The ones behind may hold gradients that the interrupted reduction left half reduced: every
        # survivor takes rank src's parameters and buffers in place (every rank holds all of them),
        # then its optimizer state.
        root = dist.get_global_rank(self.process_group, src)
        for t in self.module.state_dict().values():
            dist.broadcast(t, src=root, group=self.process_group)
        state = [self.optimizer.state_dict() if self.rank == src else None]
        dist.broadcast_object_list(state, src=root, group=self.process_group)
        if self.rank != src:
            self.optimizer.load_state_dict(state[0])

    def _share_state(self):
        # DDP's constructor broadcasts rank 0's parameters and buffers; the optimizer state follows.
        self.model = DistributedDataParallel(self.module, process_group=self.process_group, **self._ddp_kwargs)
        state = [self.optimizer.state_dict() if self.rank == 0 else None]
        dist.broadcast_object_list(state, src=0, group=self.process_group)
        if self.rank != 0:
            self.optimizer.load_state_dict(state[0])
