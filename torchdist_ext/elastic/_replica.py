"""In-memory replicas: each rank keeps a copy of its ring neighbour's parameters and optimizer state
(FSDP/ZeRO: its shards; a pipeline: its stage's layers), so that when a rank dies (but not its
replica's holder) the survivors can rebuild the whole model and optimizer state without a disk read.
The ring (``_placement.py``) is the ranks in order on one host (rank r holds rank r + 1's copy) and
alternates hosts across hosts, so that a rank's copy lives on another host than the rank.

How the copy stays current: every step, after the backward, each rank sends its gradients to its
holder (its predecessor on the ring) and receives its neighbour's (packed into one message each way per dtype, plus
which of them exist: one isend and one irecv per buffer); a one-element all_reduce then confirms that every
rank has its neighbour's gradients before any rank steps. After the rank's own ``optimizer.step()``
the holder runs the same optimizer (built by the same ``optimizer_fn``, with the owner's current
hyper-parameters) on its replica with the received gradients: the replica follows the owner bit
for bit (the same elementwise update on tensors of the same size) and moves one gradient per
parameter per step instead of the parameter and every state tensor. Sending the state after the
step instead would leave a window (a rank that dies after stepping but before its copy arrived) in
which its state is lost; here a step commits only once every copy's inputs arrived.

The refresh is asynchronous: the replica's update of step k does not run in step k. It runs in
step k + 1, after that step's gradients were handed to the send (``isend``, progressed by the
backend's thread) and before the receive of step k + 1 is posted into the same buffer, so it
overlaps the exchange and the wait for the slowest rank. No step is lost by the delay: from the
commit of step k until that update, the holder keeps everything it needs in its own memory (the
replica as of step k - 1, step k's gradients in the receive buffer, step k's hyper-parameters);
nothing of it waits on a peer, and a recovery (or a snapshot) applies a pending update first.
Until the commit of step k, no rank has stepped k, so the failure of any rank at any point of
the step leaves every survivor and every replica at step k - 1. A failure that interrupts the
commit's all_reduce on some survivors after it completed on others leaves them one step apart; the
ones behind then hold everything step k needs (every rank had entered that all_reduce) and take it
themselves after the shrink (``ReplicatedTrainer._catch_up``).

``NeighbourReplica`` is that copy for any list of parameters; ``rebuild_full`` and ``shard_of``
are ElasticFSDP's rebuild from it (ElasticPipeline's is ``gather_stages`` in ``_pipeline.py``).
"""
import torch
import torch.distributed as dist
from torch import nn

from ._placement import Ring, group_node_ids, replica_ring
from ._trainer import ElasticTrainer

_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _shard_shaped(value, shard):
    return isinstance(value, torch.Tensor) and value.shape == shard.shape


def _nbytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def exchange_with_neighbours(group, ring, mine, theirs, between=None):
    """Sends each tensor of ``mine`` to this rank's holder on ``ring`` (a ``Ring`` of ``group``'s
    ranks) and receives each of ``theirs`` from its source; ``between()`` runs after the sends are
    posted and before the receives are (it may still read ``theirs``)."""
    rank = dist.get_rank(group)
    holder, source = dist.get_global_rank(group, ring.holder(rank)), dist.get_global_rank(group, ring.source(rank))
    works = [dist.isend(t, holder, group=group) for t in mine]
    if between is not None:
        between()
    works += [dist.irecv(t, source, group=group) for t in theirs]
    for work in works:
        work.wait()


class NeighbourReplica:
    """This rank's stepped copy of its ring source's parameters and optimizer state.

    Args:
        group: the process group.
        ring: a ``Ring`` of ``group``'s ranks: this rank holds ``ring.source(rank)``'s state and
            ``ring.holder(rank)`` holds this rank's.
        own: this rank's parameters, in an order its holder's replica agrees on; their ``.grad``
            is what is sent every step (the trainable ones, with ``requires_grad``).
        params: the neighbour's parameters as this rank's replica of them (``nn.Parameter``s this
            object steps in place), aligned with the neighbour's ``own``.
        optimizer_fn: what built the neighbour's optimizer; builds the replica's the same way.
        order: the order of ``params`` in which the neighbour's optimizer was built (indices;
            default: as given).
        states: the neighbour's optimizer state per parameter (None: empty, as before the first step).
    """

    def __init__(self, group, ring, own, params, optimizer_fn, order=None, states=None):
        self.group, self.ring = group, ring
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        if self.world_size < 2:
            raise ValueError("NeighbourReplica: a group of one rank has no neighbour to replicate")
        if len(ring) != self.world_size:
            raise ValueError(f"NeighbourReplica: the ring {ring} does not cover the group's {self.world_size} ranks")
        self.source = ring.source(self.rank)  # whose parameters this rank holds
        self.holder = ring.holder(self.rank)  # who holds this rank's
        self.params = list(params)
        order = range(len(self.params)) if order is None else order
        self.optimizer = optimizer_fn([self.params[i] for i in order])
        if states is not None:
            for p, state in zip(self.params, states):
                if state:
                    self.optimizer.state[p] = state
        self._own = [p for p in own if p.requires_grad]
        self._theirs = [i for i, p in enumerate(self.params) if p.requires_grad]
        # The gradients travel packed: one message each way per (dtype, device), and a mask of
        # which exist (a parameter unused in the step has none, and its optimizer skips it).
        self._send = self._packing(self._own)
        self._recv = self._packing([self.params[i] for i in self._theirs])
        self._mask_out = torch.empty(len(self._own), dtype=torch.uint8)
        self._mask_in = torch.empty(len(self._theirs), dtype=torch.uint8)
        self._flag = torch.zeros(1)  # the commit's one-element all_reduce, every step
        # (parameter index, gradient view of the receive buffer) of the step whose exchange completed
        # (None: no exchange since the last recorded step)
        self._received = None
        self._pending = None  # (received, hyper-parameters): a committed step the replica has not taken

    @staticmethod
    def _packing(tensors):
        """{(dtype, device): (indices into tensors, one buffer of their total size)}."""
        out = {}
        for i, t in enumerate(tensors):
            out.setdefault((t.dtype, t.device), []).append(i)
        return {k: (idx, torch.empty(sum(tensors[i].numel() for i in idx), dtype=k[0], device=k[1]))
                for k, idx in out.items()}

    def exchange_grads(self):
        """Sends this rank's gradients to its holder and receives the neighbour's; returns once every
        rank of the group has its neighbour's (the step may then commit everywhere). While the
        sends are in flight, the replica takes the previous step (``apply_pending``)."""
        self._received = None
        with torch.no_grad():
            for i, p in enumerate(self._own):
                self._mask_out[i] = p.grad is not None
            for idx, buf in self._send.values():
                offset = 0
                for i in idx:
                    p = self._own[i]
                    piece = buf[offset:offset + p.numel()]
                    if p.grad is None:
                        piece.zero_()
                    else:
                        piece.copy_(p.grad.reshape(-1))
                    offset += p.numel()
            exchange_with_neighbours(self.group, self.ring, [self._mask_out] + [b for _, b in self._send.values()],
                                     [self._mask_in] + [b for _, b in self._recv.values()], between=self.apply_pending)
        received = []
        for idx, buf in self._recv.values():
            pieces = buf.split([self.params[self._theirs[i]].numel() for i in idx])
            received += [(self._theirs[i], g) for i, g in zip(idx, pieces) if self._mask_in[i]]
        self._received = received
        dist.all_reduce(self._flag, group=self.group)  # every copy's inputs arrived: commit

    def arrived(self):
        """Whether the neighbour's gradients of the step being taken arrived (its exchange completed),
        so that ``step`` may record it."""
        return self._received is not None

    def step(self, optimizer):
        """Records the neighbour's ``optimizer.step()`` of the exchanged step for the replica, with
        ``optimizer``'s current hyper-parameters (an LR scheduler's changes included); call it once
        that step committed. The update itself runs in the next ``exchange_grads`` (overlapping its
        sends) or at ``apply_pending``."""
        if self._received is None:
            raise RuntimeError("torchdist_ext.elastic: the replica records a step whose gradient exchange did not "
                               "complete; call step(optimizer) only after exchange_grads returned")
        if len(optimizer.param_groups) != len(self.optimizer.param_groups):
            raise ValueError(f"torchdist_ext.elastic: the optimizer has {len(optimizer.param_groups)} parameter groups "
                             f"but its replica of the neighbour's has {len(self.optimizer.param_groups)}; the replica "
                             "takes the owner's hyper-parameters group by group, so optimizer_fn must build the same "
                             "number of groups for every rank's parameters")
        hyper = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in g.items() if k != "params"}
                 for g in optimizer.param_groups]
        self._pending, self._received = (self._received, hyper), None

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
        """(parameters, optimizer states) of the replica as of the last committed step, one per
        parameter (for tests and checks)."""
        self.apply_pending()
        return ([p.detach().clone() for p in self.params],
                [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.optimizer.state[p].items()}
                 for p in self.params])

    def nbytes(self):
        """{"shards", "optimizer", "buffers"}: bytes this replica holds (the neighbour's parameters,
        its optimizer state, and the packed gradient send and receive buffers)."""
        self.apply_pending()
        state = [v for p in self.params for v in self.optimizer.state.get(p, {}).values()
                 if isinstance(v, torch.Tensor)]
        return {"shards": _nbytes(self.params), "optimizer": _nbytes(state),
                "buffers": _nbytes([b for packing in (self._send, self._recv) for _, b in packing.values()])}

    def state_of(self, index):
        """The replica's optimizer state of parameter ``index`` ({} before the first step), as of the
        last committed step."""
        self.apply_pending()
        return self.optimizer.state.get(self.params[index], {})


class ReplicatedTrainer(ElasticTrainer):
    """An elastic trainer whose ranks keep a ``NeighbourReplica`` (``self.replica``, None on one
    rank) stepped after their own ``optimizer.step()``. ``_replicated`` names what a rank's
    replica holds, for the error when it dies with its holder."""

    _replicated = "parameters and optimizer state"

    def __init__(self, process_group, sampler, max_recoveries, rejoin=False, rejoin_every=1):
        super().__init__(process_group, sampler, max_recoveries, rejoin, rejoin_every)
        if self._joining is None:  # a joiner learns them with the state (_share_state)
            self._node_ids = group_node_ids(self.process_group)  # host of every original member
            self.ring = self._replica_ring()

    def _replica_ring(self):
        """The replica ring of the current members (ring neighbours on different hosts)."""
        return Ring(replica_ring([self._node_ids[m] for m in self.members]))

    def _commit(self):
        self.optimizer.step()
        if self.replica is not None:
            self.replica.step(self.optimizer)

    def _catch_up(self, src, behind, why):
        """The ones behind finish the step themselves. A survivor is ahead only once the step's
        commit (the one-element all_reduce after the gradient exchange, the step's last
        collective) completed on it, so every rank had entered that all_reduce: each one behind
        already holds the reduced gradients of its own parameters and, in its replica's receive
        buffer, its neighbour's. Only the local optimizer step and the replica's record of it
        (``_commit``) are left, with this rank's hyper-parameters of that step; then every rank
        and every replica stands at the new step, with the same values as if the commit had
        completed everywhere, and nothing of the ones ahead has to move or go back. A rank behind
        whose exchange had not completed (not expected) makes every survivor raise."""
        missing = behind and (self.replica is None or not self.replica.arrived())
        flag = torch.tensor([int(missing)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
        if int(flag):
            raise RuntimeError(why + f", and a rank behind had not received its neighbour's gradients of that step, so "
                               f"{type(self).__name__} cannot complete it there; restart from a checkpoint")
        if behind:
            self._commit()

    def _check_recoverable(self, gone, error):
        n = self.world_size
        lost = sorted(d for d in gone if self.ring.holder(d) in gone)
        if lost:
            pairs = ", ".join(f"rank {d} (its replica was on rank {self.ring.holder(d)})" for d in lost)
            raise RuntimeError(
                f"torchdist_ext.elastic.{type(self).__name__}: ranks {sorted(gone)} of {n} died together, and the "
                f"{self._replicated} of {pairs} died with their only replica, so the survivors cannot rebuild the "
                "model in memory. Restart from a checkpoint (e.g. torchrun --max-restarts with per-epoch "
                "checkpoints); in-memory recovery survives the loss of ranks whose replica's holder survives "
                f"(the replica ring: {self.ring.order}, each rank's replica on the rank before it)") from error


def unit_order(model, optimizer):
    """For each parameter of ``optimizer`` (param_groups flattened), the index of its FSDP unit."""
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


def fsdp_replica(model, ring, optimizer, optimizer_fn, values=None, states=None):
    """ElasticFSDP's replica: of the ring source's unit shards (``values``, one per unit; None:
    fetched from the source now), with their optimizer state (``states``)."""
    units = model.units
    own = [u.shard for u in units]
    if values is None:
        values = [torch.empty_like(t.detach()) for t in own]
        with torch.no_grad():
            exchange_with_neighbours(model.process_group, ring, [t.detach().contiguous() for t in own], values)
    params = [nn.Parameter(v, requires_grad=u.trainable) for u, v in zip(units, values)]
    by_shard = {id(u.shard): i for i, u in enumerate(units)}
    replica = NeighbourReplica(model.process_group, ring, own, params, optimizer_fn,
                               [by_shard[id(p)] for p in model.parameters()], states)
    mine = {id(p): i for i, p in enumerate(replica.params)}
    if unit_order(model, optimizer) != [mine.get(id(p)) for g in replica.optimizer.param_groups for p in g["params"]]:
        raise ValueError("torchdist_ext.elastic: optimizer_fn grouped the replica's parameters differently "
                         "from the model's; it must build its parameter groups from the order of the "
                         "parameters it is given, not from their names or identities")
    return replica


def rebuild_full(units, optimizer, replica, group, old_members, excluded):
    """Every unit's whole flat parameter and optimizer state, as they were on the old group.

    ``old_members``: old group ranks of the new group's ranks, in order; ``excluded``: the old
    group ranks that died. Each survivor contributes its own shard and its replica (one
    all_gather per tensor over ``group``); the dead rank d's pieces come from its holder on the
    old ring (``replica.ring``).
    Returns ``[(flat, {state key: flat or the rank's own non-shard value})]`` per unit.
    """
    old_world = len(old_members) + len(excluded)
    new_index = {old: i for i, old in enumerate(old_members)}
    sources = []
    for q in range(old_world):
        if q in new_index:
            sources.append((new_index[q], 0))
        else:
            sources.append((new_index[replica.ring.holder(q)], 1))
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
