"""In-memory replicas for sharded training: rank r keeps a copy of rank (r + 1) % n's FSDP/ZeRO
shards and optimizer state, so that when a rank dies (but not its replica's holder) the survivors
can rebuild every unit's full flat parameter and optimizer state without a disk read.

How the copy stays current: every step, after the backward, each rank sends its reduced gradient
shards to its holder (rank r - 1) and receives its neighbour's (packed into one message each way
per shard dtype); a one-element all_reduce then confirms that every rank has its neighbour's
gradients before any rank steps. The holder runs the same optimizer (built by the same
``optimizer_fn``, with the owner's hyper-parameters of that step) on its replica with the
received gradients: the replica follows the owner bit for bit (the same elementwise update on
tensors of the same size) and moves one gradient shard per step instead of the shard and every
state tensor. Sending the state after the step instead would leave a window (a rank that dies
after stepping but before its copy arrived) in which its state is lost; here a step commits only
once every copy's inputs arrived.

The refresh is asynchronous: the replica's update of step k does not run in step k. It runs in
step k + 1, after that step's gradient shards were handed to the send (``isend``, progressed by
the backend's thread) and before the receive of step k + 1 is posted into the same buffer, so it
overlaps the exchange and the wait for the slowest rank. No step is lost by the delay: from the
commit of step k until that update, the holder keeps everything it needs in its own memory (the
replica as of step k - 1, step k's gradients in the receive buffer, step k's hyper-parameters);
nothing of it waits on a peer, and a recovery (or a snapshot) applies a pending update first.
Until the commit of step k, no rank has stepped k, so the failure of any rank at any point of
the step leaves every survivor and every replica at step k - 1.
"""
import torch
import torch.distributed as dist
from torch import nn

_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _shard_shaped(value, shard):
    return isinstance(value, torch.Tensor) and value.shape == shard.shape


def unit_order(model, optimizer):
    """For each parameter of ``optimizer`` (param_groups flattened), the index of its unit."""
    index = {id(u.shard): i for i, u in enumerate(model.units)}
    order = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in index:
                raise ValueError("torchdist_ext.elastic: the optimizer holds a tensor that is not a shard of the "
                                 "FullyShardedDataParallel model; optimizer_fn must build the optimizer over the "
                                 "parameters it is given (the model's flat shards) and nothing else")
            order.append(index[id(p)])
    return order


class NeighbourReplica:
    """This rank's copy of rank (rank + 1) % world_size's shards and optimizer state.

    Args:
        model: the FullyShardedDataParallel model (its group, units and shards).
        optimizer: this rank's optimizer over ``model.parameters()``.
        optimizer_fn: what built ``optimizer``; builds the replica's optimizer the same way.
        values: the neighbour's shards, one per unit (None: fetched from the neighbour now).
        states: the neighbour's optimizer state per unit (None: empty, as before the first step).
    """

    def __init__(self, model, optimizer, optimizer_fn, values=None, states=None):
        self.group = model.process_group
        self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        if self.world_size < 2:
            raise ValueError("NeighbourReplica: a group of one rank has no neighbour to replicate")
        self.source = (self.rank + 1) % self.world_size  # whose shards this rank holds
        self.holder = (self.rank - 1) % self.world_size  # who holds this rank's shards
        self.units = model.units
        if values is None:
            values = self._fetch_shards()
        self.params = [nn.Parameter(v, requires_grad=u.trainable) for u, v in zip(self.units, values)]
        by_shard = {id(u.shard): i for i, u in enumerate(self.units)}
        self.optimizer = optimizer_fn([self.params[by_shard[id(p)]] for p in model.parameters()])
        mine = {id(p): i for i, p in enumerate(self.params)}
        if unit_order(model, optimizer) != [mine.get(id(p)) for g in self.optimizer.param_groups for p in g["params"]]:
            raise ValueError("torchdist_ext.elastic: optimizer_fn grouped the replica's parameters differently "
                             "from the model's; it must build its parameter groups from the order of the "
                             "parameters it is given, not from their names or identities")
        if states is not None:
            for p, state in zip(self.params, states):
                if state:
                    self.optimizer.state[p] = state
        # The gradients travel packed: one message each way per (dtype, device) of the shards.
        self._buckets = {}  # (dtype, device) -> (unit indices, send buffer, receive buffer)
        for i, u in enumerate(self.units):
            if u.trainable:
                self._buckets.setdefault((u.shard.dtype, u.shard.device), []).append(i)
        for key, members in self._buckets.items():
            numel = sum(self.units[i].shard.numel() for i in members)
            send = torch.empty(numel, dtype=key[0], device=key[1])
            self._buckets[key] = (members, send, torch.empty_like(send))
        self._flag = torch.zeros(1)  # the commit's one-element all_reduce, every step
        self._received = []  # (unit index, gradient view of the receive buffer) of the exchanged step
        self._pending = None  # (received, hyper-parameters): a committed step the replica has not taken

    def _peer(self, group_rank):
        return dist.get_global_rank(self.group, group_rank)

    def _exchange(self, mine, theirs, between=None):
        """Sends ``mine`` to the holder and receives ``theirs`` from the source; ``between()`` runs
        after the sends are posted and before the receives are (it may still read ``theirs``)."""
        holder, source = self._peer(self.holder), self._peer(self.source)
        works = [dist.isend(t, holder, group=self.group) for t in mine]
        if between is not None:
            between()
        works += [dist.irecv(t, source, group=self.group) for t in theirs]
        for work in works:
            work.wait()

    def _fetch_shards(self):
        mine = [u.shard.detach().contiguous() for u in self.units]
        theirs = [torch.empty_like(t) for t in mine]
        with torch.no_grad():
            self._exchange(mine, theirs)
        return theirs

    def exchange_grads(self):
        """Sends this rank's gradient shards to its holder and receives the neighbour's; returns once
        every rank of the group has its neighbour's (the step may then commit everywhere). While
        the sends are in flight, the replica takes the previous step (``apply_pending``)."""
        # FSDP reduces the same units on every rank, so every rank sends and expects the same units.
        mine, theirs, received = [], [], []
        with torch.no_grad():
            for members, send, recv in self._buckets.values():
                present = [i for i in members if self.units[i].shard.grad is not None]
                grads = [self.units[i].shard.grad.reshape(-1) for i in present]
                total = sum(g.numel() for g in grads)
                if grads:
                    torch.cat(grads, out=send[:total])
                    mine.append(send[:total])
                    theirs.append(recv[:total])
                    received += zip(present, recv[:total].split([g.numel() for g in grads]))
            self._exchange(mine, theirs, between=self.apply_pending)
        dist.all_reduce(self._flag, group=self.group)  # every copy's inputs arrived: commit
        self._received = received

    def step(self, optimizer):
        """Records the neighbour's ``optimizer.step()`` of the exchanged step for the replica, with
        ``optimizer``'s current hyper-parameters (an LR scheduler's changes included); call it once
        that step committed. The update itself runs in the next ``exchange_grads`` (overlapping its
        sends) or at ``apply_pending``."""
        hyper = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in g.items() if k != "params"}
                 for g in optimizer.param_groups]
        self._pending, self._received = (self._received, hyper), []

    def apply_pending(self):
        """Runs the replica's update of the last committed step if it has not run yet (local work:
        the gradients arrived before that step committed)."""
        if self._pending is None:
            return
        received, hyper = self._pending
        for own, mine in zip(hyper, self.optimizer.param_groups):
            mine.update(own)
        for i, grad in received:
            self.params[i].grad = grad.view(self.params[i].shape)
        self.optimizer.step()
        for p in self.params:
            p.grad = None
        self._pending = None

    def snapshot(self):
        """(shards, optimizer states) of the replica as of the last committed step, one per unit
        (for tests and checks)."""
        self.apply_pending()
        return ([p.detach().clone() for p in self.params],
                [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.optimizer.state[p].items()}
                 for p in self.params])

    def nbytes(self):
        """{"shards", "optimizer", "buffers"}: bytes this replica holds (the neighbour's shards, its
        optimizer state, and the packed gradient send and receive buffers)."""
        def size(tensors):
            return sum(t.numel() * t.element_size() for t in tensors)

        state = [v for p in self.params for v in self.optimizer.state.get(p, {}).values()
                 if isinstance(v, torch.Tensor)]
        return {"shards": size(self.params), "optimizer": size(state),
                "buffers": size([t for _, send, recv in self._buckets.values() for t in (send, recv)])}

    def state_of(self, unit_index):
        """The replica's optimizer state of unit ``unit_index`` ({} before the first step), as of the
        last committed step."""
        self.apply_pending()
        return self.optimizer.state.get(self.params[unit_index], {})


def rebuild_full(units, optimizer, replica, group, old_members, excluded):
    """Every unit's whole flat parameter and optimizer state, as they were on the old group.

    ``old_members``: old group ranks of the new group's ranks, in order; ``excluded``: the old
    group ranks that died. Each survivor contributes its own shard and its replica (one
    all_gather per tensor over ``group``); the dead rank d's pieces come from its holder d - 1.
    Returns ``[(flat, {state key: flat or the rank's own non-shard value})]`` per unit.
    """
    old_world = len(old_members) + len(excluded)
    new_index = {old: i for i, old in enumerate(old_members)}
    sources = []
    for q in range(old_world):
        if q in new_index:
            sources.append((new_index[q], 0))
        else:
            sources.append((new_index[(q - 1) % old_world], 1))
    own_state = {id(p): optimizer.state.get(p, {}) for g in optimizer.param_groups for p in g["params"]}
    out = []
    for i, unit in enumerate(units):
        shard = unit.shard.detach()
        mine = own_state.get(id(unit.shard), {})
        theirs = replica.state_of(i)
        keys = sorted(k for k, v in mine.items() if _shard_shaped(v, shard))
        if sorted(k for k, v in theirs.items() if _shard_shaped(v, shard)) != keys:
            raise RuntimeError(f"torchdist_ext.elastic: the replica's optimizer state of unit {i} has keys "
                               f"{sorted(theirs)} but this rank's has {sorted(mine)}; the replica fell out of step")
        flats = []
        for own, rep in [(shard, replica.params[i].detach())] + [(mine[k], theirs[k]) for k in keys]:
            both = torch.cat([own.reshape(-1), rep.reshape(-1)])
            gathered = torch.empty(len(old_members) * both.numel(), dtype=both.dtype, device=both.device)
            _GATHER(gathered, both, group=group)
            gathered = gathered.view(len(old_members), 2, -1)
            flats.append(torch.cat([gathered[r, slot] for r, slot in sources]))
        state = {k: v for k, v in mine.items() if k not in keys}
        state.update(zip(keys, flats[1:]))
        out.append((flats[0], state))
    return out


def shard_of(flat_state, layout, rank):
    """(shard, optimizer state) of ``rank`` under ``layout`` from a whole flat parameter and state
    laid out by another world size (interior offsets do not depend on it; only the tail padding
    does, and it is zero)."""
    flat, state = flat_state
    begin, end = layout.shard_range(rank)

    def piece(t):
        if not _shard_shaped(t, flat):
            return t.clone() if isinstance(t, torch.Tensor) else t
        out = torch.zeros(layout.padded_numel, dtype=t.dtype, device=t.device)
        n = min(layout.unpadded_numel, t.numel())
        out[:n] = t[:n]
        return out[begin:end].clone()

    return piece(flat), {k: piece(v) for k, v in state.items()}
