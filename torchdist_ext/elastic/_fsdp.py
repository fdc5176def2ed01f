"""A training step that survives the death of peers: FSDP / ZeRO (stages 1, 2, 3) whose dead
rank's shards and optimizer state come back from a neighbour's in-memory replica."""

import torch.distributed as dist

from ..fsdp import FullyShardedDataParallel
from ._placement import group_node_ids
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
        rejoin, rejoin_every: admit restarted ranks at a step boundary, as ``ElasticDDP``; the
            module is re-sharded at the larger size and the joiner gets its shards, their optimizer
            state and its replica from the members' whole state, broadcast from rank 0.
        **fsdp_kwargs: passed to ``FullyShardedDataParallel`` (``stage`` included; default 3) and
            again when it is rebuilt. ``mixed_precision`` works (the replica exchanges and steps the
            fp32 master gradients and shards); ``cpu_offload`` is refused (it acts only on CUDA
            modules, and CUDA groups cannot recover).

    ``step(loss_fn, *args)`` runs zero_grad, ``loss = loss_fn(model, *args)``, ``loss.backward()``,
    the replica's gradient exchange (during which the replica takes the previous step) and
    ``optimizer.step()``. ``recoveries`` lists what each recovery did and how long it took.
    """

    _replicated = "shards and optimizer state"

    def __init__(self, module, optimizer_fn, process_group=None, sampler=None, max_recoveries=None, rejoin=False,
                 rejoin_every=1, **fsdp_kwargs):
        offload = fsdp_kwargs.get("cpu_offload", False)
        if getattr(offload, "offload_params", offload):  # a bool, or torch's CPUOffload
            raise ValueError(f"ElasticFSDP: cpu_offload={offload!r} is not supported: it acts only on CUDA modules, "
                             "whose groups move tensors through NCCL and cannot shrink in place; leave cpu_offload "
                             "out (on CPU modules it would change nothing)")
        if not callable(optimizer_fn):
            raise TypeError(f"ElasticFSDP: optimizer_fn must be a callable params -> optimizer (e.g. functools."
                            f"partial(torch.optim.AdamW, lr=1e-3)), got {type(optimizer_fn).__name__}")
        self.module = module
        self.optimizer_fn = optimizer_fn
        self._fsdp_kwargs = fsdp_kwargs
        self.optimizer = None
        super().__init__(process_group, sampler, max_recoveries, rejoin, rejoin_every)
        if self._joining is not None:
            self._full = None
            self._share_state()
            return
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

    def _before_reform(self):
        """Every unit's whole flat parameter and optimizer state, gathered on the old group, and the
        module given back with them, to be wrapped again over the group a joiner entered."""
        if self.replica is None:  # one rank: its shards are whole
            states = self.optimizer.state
            full = [(u.shard.detach().clone(), dict(states.get(u.shard, {}))) for u in self.model.units]
        else:
            self.replica.apply_pending()
            full = rebuild_full(self.model.units, self.optimizer, self.replica, self.process_group,
                                list(range(self.world_size)), [])
        self._old_shards = [u.shard for u in self.model.units]
        self.module = self.model.release([flat for flat, _ in full])
        self._full = full

    def _share_state(self):
        """Rank 0 sends the whole state (flat parameters, optimizer state and hyper-parameters) to
        the group a joiner entered; every rank wraps the module again and takes its shards."""
        box = [(self._full, [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups])
               if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.process_group)
        full, hyper = box[0]
        self._full = None
        # FSDP's constructor broadcasts rank 0's parameters: a joiner's module takes them.
        self.model = FullyShardedDataParallel(self.module, process_group=self.process_group, **self._fsdp_kwargs)
        units = self.model.units
        if self.optimizer is None:  # a joiner: its optimizer over its shards, the members' hyper-parameters
            self.optimizer = self.optimizer_fn(self.model.parameters())
            for group, values in zip(self.optimizer.param_groups, hyper):
                group.update(values)
            groups = [list(g["params"]) for g in self.optimizer.param_groups]
        else:
            new_of = {id(old): u.shard for old, u in zip(self._old_shards, units)}
            groups = [[new_of[id(p)] for p in g["params"]] for g in self.optimizer.param_groups]
        repoint_optimizer(self.optimizer, groups,
                          {u.shard: shard_of(flat_state, u.layout, self.rank)[1] for u, flat_state in zip(units, full)})
        self._node_ids = group_node_ids(self.process_group)
        self.ring = self._replica_ring()
        source = self.ring.source(self.rank) if self.world_size > 1 else None
        pieces = [shard_of(flat_state, u.layout, source) for u, flat_state in zip(units, full)] if source is not None else []
        self.replica = self._new_replica([v for v, _ in pieces], [s for _, s in pieces])

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
