"""A training step that survives the death of peers: a pipeline (one stage per rank) whose dead
stage's layers and optimizer state come back from its neighbour's in-memory replica, re-split over
the survivors; with ``rejoin``, a restarted rank is admitted and the stages re-split over the larger
group from the members' values."""
import torch
import torch.distributed as dist
from torch import nn

from ..pipeline import PipelineScheduleSingle, PipelineStage, Schedule1F1B, split_sequential
from ._placement import group_node_ids
from ._replica import NeighbourReplica, ReplicatedTrainer, exchange_with_neighbours
from ._trainer import repoint_optimizer

__all__ = ["ElasticPipeline"]


class ElasticPipeline(ReplicatedTrainer):
    """Pipeline parallelism (``nn.Sequential`` split into one stage per rank, GPipe or 1F1B) plus
    recovery: every rank keeps a replica of another stage's layers and optimizer state (on one host
    rank r holds stage (r + 1) % n's, the last stage holds stage 0's; across hosts the replica ring
    alternates hosts, so a stage's replica lives on another host; kept current every step); when a peer
    dies during a step, the survivors shrink the process group in place, reassemble the whole
    model and optimizer state from their own stages plus the dead stage's replica, re-split the
    model over the new world size (new stages and schedule, the same optimizer object re-pointed
    at the new stage's parameters) and retry the step. No restart, no disk read. A stage is lost
    for good when its replica's holder dies with it: the error says so.

    Args:
        model: the whole ``nn.Sequential`` (every rank builds the same one; it is split by
            parameter count with ``split_sequential``). Layers that are neither this rank's stage
            nor its replica are released to the meta device (and materialized again by a recovery).
            Layers with buffers (BatchNorm's running statistics) are refused: the replica steps
            parameters only.
        optimizer_fn: ``optimizer_fn(params) -> torch.optim.Optimizer``, called with a stage's
            parameters (this rank's, the replica's, and again after a re-split); it must group
            them by their order, not their names. ``trainer.optimizer`` stays the same object
            across recoveries (LR schedulers keep working).
        n_microbatches: micro-batches per step (the batch must be divisible by it).
        loss_fn: ``loss_fn(output, target)`` of one micro-batch (the last stage runs it).
        schedule: a one-stage-per-rank schedule class (``Schedule1F1B`` or ``ScheduleGPipe``).
        process_group: a tdx group, on one host or spanning hosts (default: the default group).
        max_recoveries: how many failures to survive before re-raising (None: as many as ranks allow).
        device: the device the stages compute on.
        batch_weight_grads: passed to ``PipelineStage`` (None: where batching pays; False: weight gradients micro-batch by
            micro-batch, as autograd on the unsplit model accumulates them).
        rejoin, rejoin_every: admit restarted ranks at a step boundary, as ``ElasticDDP``: the group
            is re-formed at the larger size, every stage goes from the member that runs it to every
            rank (the joiner included), the model is re-split over the whole group (joiners get the
            last stages; the members' stages move too) and every rank takes its stage, its optimizer
            state and a new replica from those values, so no stage is left without a copy. The
            joiner builds its optimizer with ``optimizer_fn`` and rank 0's hyper-parameters, and
            passes the steps' whole batches from ``joined()["step"]`` on. During an admission each
            rank holds the whole model and optimizer state for a moment (as during a recovery).
            The larger group must still split the model into stages that each have parameters:
            otherwise the split's ``ValueError`` is raised on every rank (the job ends).

    ``step(*inputs, target=...)``: every rank passes the same whole batch (a recovery may make any
    rank the first or the last stage); the first stage splits ``inputs``, the last ``target``.
    It runs zero_grad, the schedule (forwards and backwards of every micro-batch), the replica's
    gradient exchange (during which the replica takes the previous step), ``optimizer.step()``,
    and records this step for the replica (taken in the next exchange), and returns the mean of the
    micro-batch losses on the last stage, None elsewhere. ``recoveries`` lists what each recovery
    did and how long it took, ``rejoins`` each admission.
    """

    _replicated = "stage (layers and optimizer state)"

    def __init__(self, model, optimizer_fn, n_microbatches, loss_fn, schedule=Schedule1F1B, process_group=None,
                 max_recoveries=None, device="cpu", batch_weight_grads=None, rejoin=False, rejoin_every=1):
        super().__init__(process_group, None, max_recoveries, rejoin, rejoin_every)
        if not isinstance(model, nn.Sequential):
            raise TypeError(f"ElasticPipeline: model must be an nn.Sequential (it is re-split over the survivors "
                            f"after a failure), got {type(model).__name__}")
        if not callable(optimizer_fn):
            raise TypeError(f"ElasticPipeline: optimizer_fn must be a callable params -> optimizer (e.g. functools."
                            f"partial(torch.optim.Adam, lr=1e-3)), got {type(optimizer_fn).__name__}")
        if not (isinstance(schedule, type) and issubclass(schedule, PipelineScheduleSingle)):
            raise TypeError(f"ElasticPipeline: schedule must be a one-stage-per-rank schedule class (Schedule1F1B or "
                            f"ScheduleGPipe), got {schedule!r}")
        buffers = [name for name, _ in model.named_buffers()]
        if buffers:
            raise ValueError(f"ElasticPipeline: the model has buffers {buffers}, which change in the forward pass and "
                             "which the replica (stepped from gradients) does not follow; use layers without buffers "
                             "(e.g. LayerNorm instead of BatchNorm)")
        self.module = model
        self.optimizer_fn = optimizer_fn
        self.n_microbatches, self.loss_fn, self.schedule_class = n_microbatches, loss_fn, schedule
        self.device = torch.device(device)
        self.batch_weight_grads = batch_weight_grads
        self.optimizer = None
        if self._joining is not None:
            self._share_state()
            return
        self.parts = self._split()
        own = self._own()
        self.optimizer = optimizer_fn(list(own.parameters()))
        if self.world_size > 1:  # the replica starts from the neighbour's values, whatever this rank built
            with torch.no_grad():
                exchange_with_neighbours(self.process_group, self.ring, [p.detach() for p in own.parameters()],
                                         [p.detach() for p in self._next().parameters()])
        self._build()

    def _split(self, n=None):
        n = self.world_size if n is None else n
        parts = split_sequential(self.module, n)
        empty = [i for i, part in enumerate(parts) if not any(p.requires_grad for p in part.parameters())]
        if empty:
            raise ValueError(f"ElasticPipeline: splitting the model over {n} ranks by parameter count "
                             f"leaves stages {empty} without trainable parameters ({[list(part) for part in parts]}); "
                             "group parameter-free layers (activations) with a layer that has parameters, e.g. "
                             "nn.Sequential(nn.Linear(...), nn.Tanh()) as one layer of the model")
        return parts

    def _own(self):
        return self.parts[self.rank]

    def _next(self):
        """The stage whose replica this rank holds (its source on the replica ring)."""
        return self.parts[self.ring.source(self.rank)]

    def _build(self, replica_states=None):
        """Stage, schedule and replica over the current group and split; releases the other layers."""
        n, r = self.world_size, self.rank
        self.stage = PipelineStage(self._own(), r, n, self.device, group=self.process_group,
                                   batch_weight_grads=self.batch_weight_grads)
        self.schedule = self.schedule_class(self.stage, self.n_microbatches, loss_fn=self.loss_fn)
        held = {r, self.ring.source(r)}
        for i, part in enumerate(self.parts):
            if i not in held:
                part.to("meta")
        for p in self._next().parameters():
            p.grad = None  # a layer this rank trained before the re-split: the replica steps only what it receives
        self.replica = None
        if n > 1:
            self.replica = NeighbourReplica(self.process_group, self.ring, list(self._own().parameters()),
                                            list(self._next().parameters()), self.optimizer_fn, states=replica_states)

    def step(self, *inputs, target=None):
        """One training step over the whole batch, retried on the survivors when a peer fails;
        returns the mean micro-batch loss (detached) on the last stage, None elsewhere."""
        return self._retrying(inputs, target)

    def _attempt(self, inputs, target):
        self.optimizer.zero_grad(set_to_none=True)
        losses = [] if self.stage.is_last else None
        kwargs = {"target": target, "losses": losses} if self.stage.is_last else {}
        self.schedule.step(*(inputs if self.stage.is_first else ()), return_outputs=False, **kwargs)
        if self.replica is not None:
            self.replica.exchange_grads()
        return torch.stack(losses).mean() if losses else None

    def _held(self, mine):
        """{old stage: [optimizer state per parameter]} of the stages this rank holds: ``mine`` (its own
        stage in the current split) and its replica's (as of the last step every rank committed)."""
        held = {mine: [self.optimizer.state.get(p, {}) for p in self.parts[mine].parameters()]}
        if self.replica is not None:
            self.replica.apply_pending()
            held[self.ring.source(mine)] = [self.replica.state_of(i) for i in range(len(self.replica.params))]
        return held

    def _rebuild(self, excluded, old_world_size):
        old_members = [r for r in range(old_world_size) if r not in excluded]
        held = self._held(old_members[self.rank])  # this rank's stage in the old split, and its replica
        holder = {old: new for new, old in enumerate(old_members)}
        sources = [holder[s] if s in holder else holder[self.ring.holder(s)] for s in range(old_world_size)]
        self._place(gather_stages(self.process_group, self.parts, held, sources, self.device))

    def _share_state(self):
        """After the group was re-formed at the larger size for joiners (collective over the new group,
        joiners included): every stage of the members' split goes from the member that runs it to
        every rank (``gather_stages``), then the model is re-split over the whole group and every
        rank takes its new stage, its optimizer state and its new replica from those values, as in
        a shrink. A joiner builds its optimizer with ``optimizer_fn`` and takes rank 0's
        hyper-parameters."""
        joiner = self.optimizer is None
        box = [(len(self.parts), [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups])
               if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.process_group)
        old_world_size, hyper = box[0]
        if joiner:  # the members' split, to receive it into (its values are the members')
            self.parts, self.replica = self._split(old_world_size), None
        self._node_ids = group_node_ids(self.process_group)
        held = {} if joiner else self._held(self.rank)  # the members keep their ranks: old stage r is on rank r
        self._place(gather_stages(self.process_group, self.parts, held, list(range(old_world_size)), self.device),
                    hyper if joiner else None)

    def _place(self, states, hyper=None):
        """The model re-split over the current group from whole values (every layer materialized)
        and their optimizer ``states`` ({parameter: state}): ``trainer.optimizer`` pointed at this
        rank's new stage (made by ``optimizer_fn`` with ``hyper`` on a joiner), then the stage,
        schedule and replica built."""
        self.parts = self._split()
        self.ring = self._replica_ring()
        own = list(self._own().parameters())
        fresh = self.optimizer_fn(own)
        if self.optimizer is None:
            self.optimizer = fresh
            for group, values in zip(fresh.param_groups, hyper):
                group.update(values)
        repoint_optimizer(self.optimizer, [g["params"] for g in fresh.param_groups], states)
        self._build([states.get(p, {}) for p in self._next().parameters()] if self.world_size > 1 else None)


def _describe(state):
    """(tensor keys with (shape, dtype), the other values) of one parameter's optimizer state."""
    tensors = sorted((k, tuple(v.shape), v.dtype) for k, v in state.items() if isinstance(v, torch.Tensor))
    return tensors, {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}


def gather_stages(group, parts, held, sources, device):
    """Every old stage's layer values and optimizer state on every rank of ``group`` (the survivors).

    ``parts``: the old split; ``held``: {old stage: [optimizer state per parameter]} of the stages
    this rank holds (its own and its replica: their layers hold the values); ``sources``: the new
    group rank that holds each old stage. Each stage is broadcast from its source (one message per
    dtype); released layers are materialized first. Returns {parameter: optimizer state}.
    """
    rank = dist.get_rank(group)
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, {s: [_describe(st) for st in states] for s, states in held.items()}, group=group)
    out = {}
    for s, part in enumerate(parts):
        src = sources[s]
        if any(p.is_meta for p in part.parameters()):
            part.to_empty(device=device)
        params = list(part.parameters())
        layout = everyone[src][s]
        if src == rank:
            states = held[s]
        else:
            states = [{k: torch.empty(shape, dtype=dtype, device=device) for k, shape, dtype in tensors} | dict(other)
                      for tensors, other in layout]
        moved = [p.detach() for p in params] + [st[k] for st, (tensors, _) in zip(states, layout)
                                                for k, _, _ in tensors]
        by_dtype = {}
        for t in moved:
            by_dtype.setdefault(t.dtype, []).append(t)
        with torch.no_grad():
            for dtype, tensors in by_dtype.items():
                flat = torch.cat([t.reshape(-1) for t in tensors]) if src == rank else torch.empty(
                    sum(t.numel() for t in tensors), dtype=dtype, device=device)
                dist.broadcast(flat, src=dist.get_global_rank(group, src), group=group)
                if src != rank:
                    for t, piece in zip(tensors, flat.split([t.numel() for t in tensors])):
                        t.copy_(piece.view(t.shape))
        out.update((p, st) for p, st in zip(params, states) if st)
    return out
