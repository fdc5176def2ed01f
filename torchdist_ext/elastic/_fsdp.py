"""A training step that survives the death of peers: FSDP / ZeRO (stages 1, 2, 3) whose dead
rank's shards and optimizer state come back from a neighbour's in-memory replica."""

from ..fsdp import FullyShardedDataParallel
from ._replica import ReplicatedTrainer, fsdp_replica, rebuild_full, shard_of
from ._trainer import repoint_optimizer

__all__ = ["ElasticFSDP"]


class ElasticFSDP(ReplicatedTrainer):
    """Our ``FullyShardedDataParallel`` plus recovery: every rank keeps a replica of its neighbour's
    shards and optimizer state (on one host rank r holds rank (r + 1) % n's; across hosts the
    neighbours alternate hosts, so a rank's replica lives on another host; kept current every step); when a
    peer dies during a step, the survivors shrink the process group in place, rebuild every unit's
    full flat parameter and optimizer state from their own shards plus the dead rank's replica,
    re-shard them over the new world size (a new wrapper, the same optimizer object re-pointed at
    the new shards), re-split the sampler and retry the step. No restart, no disk read. A rank dies
    unrecoverably when its replica's holder dies with it: the error says so.

    Args:
        module: the model (every rank builds the same one).
        optimizer_fn: ``optimizer_fn(params) -> torch.optim.Optimizer`` (e.g.
            ``functools.partial(torch.optim.AdamW, lr=1e-3)``); called with the wrapper's shards and
            again with the replica's, so it must group parameters by their order, not their names.
            ``trainer.optimizer`` stays the same object across recoveries (LR schedulers keep working).
        process_group: a tdx group, on one host or spanning hosts (default: the default group).
        sampler: an optional ``DistributedSampler`` re-split over the survivors after a failure
            (from its next epoch: the current epoch's batches of the dead rank are lost).
        max_recoveries: how many failures to survive before re-raising (None: as many as ranks allow).
        **fsdp_kwargs: passed to ``FullyShardedDataParallel`` (``stage`` included; default 3) and
            again when it is rebuilt. ``mixed_precision`` works (the replica exchanges and steps the
            fp32 master gradients and shards); ``cpu_offload`` is refused (it acts only on CUDA
            modules, and CUDA groups cannot recover).

    ``step(loss_fn, *args)`` runs zero_grad, ``loss = loss_fn(model, *args)``, ``loss.backward()``,
    the replica's gradient exchange (during which the replica takes the previous step) and
    ``optimizer.step()``. ``recoveries`` lists what each recovery did and how long it took.
    """

    _replicated = "shards and optimizer state"

    def __init__(self, module, optimizer_fn, process_group=None, sampler=None, max_recoveries=None, **fsdp_kwargs):
        offload = fsdp_kwargs.get("cpu_offload", False)
        if getattr(offload, "offload_params", offload):  # a bool, or torch's CPUOffload
            raise ValueError(f"ElasticFSDP: cpu_offload={offload!r} is not supported: it acts only on CUDA modules, "
                             "whose groups move tensors through NCCL and cannot shrink in place; leave cpu_offload "
                             "out (on CPU modules it would change nothing)")
        super().__init__(process_group, sampler, max_recoveries)
        if not callable(optimizer_fn):
            raise TypeError(f"ElasticFSDP: optimizer_fn must be a callable params -> optimizer (e.g. functools."
                            f"partial(torch.optim.AdamW, lr=1e-3)), got {type(optimizer_fn).__name__}")
        self.module = module
        self.optimizer_fn = optimizer_fn
        self._fsdp_kwargs = fsdp_kwargs
        self.model = FullyShardedDataParallel(module, process_group=self.process_group, **fsdp_kwargs)
        self.optimizer = optimizer_fn(self.model.parameters())
        self.replica = self._new_replica()

    def _new_replica(self, values=None, states=None):
        if self.world_size < 2:
            return None
        return fsdp_replica(self.model, self.ring, self.optimizer, self.optimizer_fn, values, states)

    def _attempt(self, loss_fn, args, kwargs):
        self.optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(self.model, *args, **kwargs)
        loss.backward()
        if self.replica is not None:
            self.replica.exchange_grads()
        return loss

    def _rebuild(self, excluded, old_world_size):
        self.replica.apply_pending()  # the replica as of the last step every survivor committed
        old_members = [r for r in range(old_world_size) if r not in excluded]
        full = rebuild_full(self.model.units, self.optimizer, self.replica, self.process_group, old_members, excluded)
        old_shards = [u.shard for u in self.model.units]
        module = self.model.release([flat for flat, _ in full])
        self.model = FullyShardedDataParallel(module, process_group=self.process_group, **self._fsdp_kwargs)
        units = self.model.units
        # The same optimizer object, pointed at the new shards with their slices of the state.
        new_of = {id(old): u.shard for old, u in zip(old_shards, units)}
        repoint_optimizer(self.optimizer, [[new_of[id(p)] for p in g["params"]] for g in self.optimizer.param_groups],
                          {u.shard: shard_of(flat_state, u.layout, self.rank)[1] for u, flat_state in zip(units, full)})
        self.ring = self._replica_ring()
        source = self.ring.source(self.rank)
        pieces = [shard_of(flat_state, u.layout, source) for u, flat_state in zip(units, full)]
        self.replica = self._new_replica([v for v, _ in pieces], [s for _, s in pieces])
