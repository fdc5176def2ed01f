"""Pipeline schedules: GPipe, 1F1B and interleaved 1F1B, executed over asynchronous isend/irecv.

Mirrors ``torch.distributed.pipelining``::

    stage = PipelineStage(stage_module, stage_index=rank, num_stages=world, device="cpu")
    schedule = Schedule1F1B(stage, n_microbatches=8, loss_fn=torch.nn.functional.cross_entropy)
    if stage.is_first:
        schedule.step(x)                          # inputs on the first stage
    elif stage.is_last:
        losses = []
        out = schedule.step(target=y, losses=losses)  # target and losses on the last
    else:
        schedule.step()                           # nothing on the middle ones

``step`` splits the batch into ``n_microbatches`` equal micro-batches along dim 0, runs the
schedule's action list for this rank (see ``pipeline_order``) and leaves in every parameter's
``.grad`` the gradient of the mean of the micro-batch losses (``scale_grads=True``; with a loss
that averages over its batch that equals the gradient of the unsplit batch's loss).
"""

import time
import weakref

import torch
import torch.distributed as dist
import torch.utils._pytree

from . import _orders
from ._actions import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, RECV_B, RECV_F, SEND_B, SEND_F,
                       Action)
from ._comm import StepComm, posts_from_thread, posts_receives_early
from ._lower import add_communication, post_at_producer
from ._meta import split_microbatches
from ._poster import Poster
from ._simulate import simulate
from .stage import PipelineStage

__all__ = ["PipelineScheduleSingle", "PipelineScheduleMulti", "ScheduleGPipe", "Schedule1F1B",
           "ScheduleInterleaved1F1B"]


class _PipelineSchedule:
    def __init__(self, stages, n_microbatches, loss_fn, scale_grads, chunk_specs=(None, None, None)):
        name = type(self).__name__
        if any(spec is not None for spec in chunk_specs):
            raise NotImplementedError(f"{name}: args_chunk_spec, kwargs_chunk_spec and output_merge_spec are not "
                                      "implemented; inputs are split along dim 0 and outputs concatenated along dim 0")
        if not isinstance(n_microbatches, int) or isinstance(n_microbatches, bool) or n_microbatches < 1:
            raise ValueError(f"{name}: n_microbatches must be a positive int, got {n_microbatches!r}")
        if loss_fn is not None and not callable(loss_fn):
            raise TypeError(f"{name}: loss_fn must be callable (e.g. torch.nn.functional.cross_entropy) or None, got "
                            f"{type(loss_fn).__name__}")
        if not stages or not all(isinstance(s, PipelineStage) for s in stages):
            raise TypeError(f"{name}: expected PipelineStage objects, got {[type(s).__name__ for s in stages]}")
        groups = {id(s.group) for s in stages}
        if len(groups) != 1:
            raise ValueError(f"{name}: the stages on one rank must share one process group")
        self._stages = {s.stage_index: s for s in stages}
        if len(self._stages) != len(stages):
            raise ValueError(f"{name}: stage indices {[s.stage_index for s in stages]} repeat")
        self._n_microbatches = n_microbatches
        self._loss_fn = loss_fn
        self.scale_grads = scale_grads
        self._group = stages[0].group
        self._num_ranks = stages[0].group_size
        self._rank = stages[0].group_rank
        self._num_stages = stages[0].num_stages
        self._prefetch = posts_receives_early(self._group, stages[0].device)
        self._poster = None
        if posts_from_thread(self._group, stages[0].device):
            group = self._group if self._group is not None else dist.distributed_c10d._get_default_group()
            self._poster = Poster(group)
            weakref.finalize(self, self._poster.stop)
        self._static_inputs = None  # filled by the first step's handshake
        self._wire_shapes = {}  # shapes both ends of each dynamic boundary agreed on (kept across steps)
        self._orders = {}
        self.record_timeline = False
        """When True, every step leaves in ``self.timeline`` ``[(action, start, end), ...]`` of this
        rank's compute actions (``time.perf_counter()`` seconds; waits for messages excluded)."""
        self.timeline = None

    # --- layout ------------------------------------------------------------------------------

    def _compute_order(self, with_backward):
        raise NotImplementedError

    def _stages_per_rank(self):
        return 1

    def _placement(self):
        """``placement[s]``: the group rank of stage s (looped: s % group size)."""
        return _orders.loop_placement(self._num_ranks, self._stages_per_rank())

    def _layout_rule(self):
        return f"stage s runs on group rank s % {self._num_ranks}"

    def _check_layout(self, num_stages, table):
        p, v = self._num_ranks, self._stages_per_rank()
        if num_stages != p * v:
            raise ValueError(f"{type(self).__name__} runs {v} stage(s) per rank, so num_stages must be {v} x the "
                             f"group size {p} = {p * v}; got num_stages={num_stages} ({table})")

    def _handshake(self):
        """Once, before the first step: every rank of the pipeline group checks that all agree."""
        mine = {"schedule": type(self).__name__, "n_microbatches": self._n_microbatches,
                "num_stages": sorted({s.num_stages for s in self._stages.values()}),
                "stages": sorted(self._stages), "loss_fn": self._loss_fn is not None,
                "inputs": {i: s.input_meta for i, s in self._stages.items() if s.input_meta is not None}}
        everyone = [None] * self._num_ranks
        dist.all_gather_object(everyone, mine, group=self._group)
        table = "; ".join(f"rank {r}: {e['schedule']}, stages {e['stages']}, num_stages {e['num_stages']}, "
                          f"n_microbatches {e['n_microbatches']}" for r, e in enumerate(everyone))
        if len({tuple(e["num_stages"]) for e in everyone}) != 1 or len(mine["num_stages"]) != 1:
            raise ValueError(f"the pipeline's stages disagree on num_stages ({table}); construct every PipelineStage "
                             "with the same num_stages")
        for key in ("schedule", "n_microbatches"):
            if len({e[key] for e in everyone}) != 1:
                raise ValueError(f"the pipeline's ranks disagree on {key} ({table}); every rank must build the same "
                                 "schedule with the same n_microbatches")
        num_stages = self._num_stages
        self._check_layout(num_stages, table)
        placement = self._placement()
        for r, e in enumerate(everyone):
            want = [s for s in range(num_stages) if placement[s] == r]
            if e["stages"] != want:
                raise ValueError(f"group rank {r} holds stages {e['stages']} but must hold {want} "
                                 f"({self._layout_rule()}) ({table})")
        self._static_inputs = {int(i): m for e in everyone for i, m in e["inputs"].items()}

    @property
    def pipeline_order(self):
        """{rank: [Action, ...]}: the whole schedule with communication, as data (``format_schedule`` prints it)."""
        return self._lowered(True)

    def _lowered(self, with_backward):
        if with_backward not in self._orders:
            compute = self._compute_order(with_backward)
            actions = add_communication(compute, self._num_stages, prefetch=self._prefetch)
            played = simulate(actions, self._num_stages, self._n_microbatches, self._num_ranks,
                              with_backward=with_backward, placement=self._placement())
            if self._prefetch:  # each receive posted when its sender starts computing it (see _lower)
                actions = post_at_producer(actions, played.timeline)
                simulate(actions, self._num_stages, self._n_microbatches, self._num_ranks,
                         with_backward=with_backward, placement=self._placement())
            split = {a.stage for a in actions[self._rank] if a.type in (BACKWARD_INPUT, BACKWARD_WEIGHT)}
            wrapped = [i for i in sorted(split) if self._stages[i].wraps_reducer]
            if wrapped:
                raise ValueError(f"{type(self).__name__}: stages {wrapped} hold DistributedDataParallel or FSDP, which "
                                 "reduce gradients as autograd accumulates them; the schedule's I/W actions compute "
                                 "weight gradients apart from autograd's accumulation. Use a schedule without I/W "
                                 "(Schedule1F1B, ScheduleInterleaved1F1B) for pp x dp")
            self._orders[with_backward] = actions
        return self._orders[with_backward]

    def simulate(self, cost=None):
        """Plays this schedule's actions for every rank (see :func:`torchdist_ext.pipeline.simulate`):
        unit costs by default (F 1, B 2, I 1, W 1), or ``cost(rank, action) -> seconds``. The result
        says the bubble fraction, the activations alive per rank and every compute action's start."""
        return simulate(self.pipeline_order, self._num_stages, self._n_microbatches, self._num_ranks,
                        placement=self._placement(), cost=cost)

    # --- public API --------------------------------------------------------------------------

    def step(self, *args, target=None, losses=None, return_outputs=True, **kwargs):
        """One training step over the whole batch: forward and backward of every micro-batch.

        args: the batch's positional inputs (first stage only); tensors are split along dim 0.
        kwargs: keyword inputs, split like args, passed to every stage on this rank (as
            torch.distributed.pipelining does): on the first stage's rank next to args, on another
            rank next to the activations it receives (e.g. an attention mask every stage needs).
        target: the batch's target (last stage only), split like the inputs.
        losses: a list (last stage) that receives the loss of every micro-batch, in order.
        return_outputs: the last stage returns the outputs of all micro-batches concatenated.
        """
        with_backward = self._loss_fn is not None
        if with_backward and not torch.is_grad_enabled():
            raise RuntimeError("step() needs gradients for its backward passes but runs under torch.no_grad(); use "
                               "eval() for forward-only passes")
        try:
            return self._run(args, kwargs, target, losses, with_backward, return_outputs)
        except BaseException:
            for s in self._stages.values():  # a failed step's kept activations go now, not at the next step
                s.clear_runtime_states()
            raise

    def eval(self, *args, target=None, losses=None, **kwargs):
        """Forward passes only (no activations kept); the last stage returns the outputs and fills ``losses``."""
        with torch.no_grad():
            return self._run(args, kwargs, target, losses, False, True)

    # --- execution ---------------------------------------------------------------------------

    def _check_inputs(self, args, kwargs, target, losses, with_loss):
        has_first = any(s.is_first for s in self._stages.values())
        has_last = any(s.is_last for s in self._stages.values())
        if args and not has_first:
            raise ValueError(f"step(): rank {self._rank} holds stages {sorted(self._stages)}, not the first stage, so it "
                             "takes no positional inputs (its stages get the previous stage's outputs); pass positional "
                             "inputs only on the rank of stage 0, or pass what these stages need as keyword inputs")
        if has_first and not (args or kwargs):
            raise ValueError("step(): the first stage needs the batch's inputs, e.g. schedule.step(x)")
        if has_last and with_loss and target is None:
            raise ValueError("step(): the last stage computes loss_fn(output, target) and needs target=...")
        if target is not None and not has_last:
            raise ValueError(f"step(): target is given on rank {self._rank}, which does not hold the last stage")
        if losses is not None and not isinstance(losses, list):
            raise TypeError(f"step(): losses must be a list to fill, got {type(losses).__name__}")

    def _run(self, args, kwargs, target, losses, with_backward, return_outputs):
        with_loss = self._loss_fn is not None and (with_backward or target is not None)
        if self._static_inputs is None:
            self._handshake()  # first: a rank whose stages disagree must not fail alone on a local check
        self._check_inputs(args, kwargs, target, losses, with_backward)
        m = self._n_microbatches
        actions = self._lowered(with_backward)[self._rank]
        split = any(a.type in (BACKWARD_INPUT, BACKWARD_WEIGHT) for a in actions)
        for s in self._stages.values():
            s.clear_runtime_states(m, split_backward=split)
        mbs = split_microbatches(args, kwargs, m) if args or kwargs else None
        targets = split_microbatches((target,), {}, m, names=["target"]) if target is not None else None
        comm = StepComm(self._stages, self._placement(), self._static_inputs, self._wire_shapes, self._poster)
        try:
            timeline = self.timeline = [] if self.record_timeline else None
            to_send, mb_losses, outputs = {}, {}, {}
            backwards_left = {i: m for i in self._stages}
            for a in actions:
                stage = self._stages[a.stage]
                mb = a.microbatch
                if timeline is not None and a.type in (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT):
                    # the wait for the action's message is not its compute: start after it
                    if a.type == FORWARD and not stage.is_first:
                        inputs = comm.wait_recv(Action(a.stage, RECV_F, mb))
                        comm.hand_back(Action(a.stage, RECV_F, mb), inputs)
                    elif a.type in (BACKWARD, BACKWARD_INPUT) and not stage.is_last:
                        grads = comm.wait_recv(Action(a.stage, RECV_B, mb))
                        comm.hand_back(Action(a.stage, RECV_B, mb), grads)
                    t0 = time.perf_counter()
                if a.type in (RECV_F, RECV_B):
                    comm.post_recv(a)
                elif a.type == SEND_F:
                    comm.send(a, to_send.pop((a.stage, mb)))
                elif a.type == SEND_B:
                    comm.send(a, stage.pop_input_grads(mb))
                elif a.type == FORWARD:
                    stage.flush_weight_grads()
                    if stage.is_first:
                        inputs, kw = mbs[mb]
                    else:
                        inputs = tuple(comm.wait_recv(Action(a.stage, RECV_F, mb)))
                        kw = mbs[mb][1] if mbs is not None else {}
                    out = stage.forward_one(mb, inputs, kw, with_backward)
                    if stage.is_last:
                        # detached: after its backward, nothing of this step should keep the graph alive
                        outputs[mb] = _detached(out)
                        if with_loss:
                            mb_losses[mb] = self._loss_fn(out, targets[mb][0][0])
                    else:
                        to_send[(a.stage, mb)] = out
                elif a.type == BACKWARD:
                    stage.flush_weight_grads()
                    backwards_left[a.stage] -= 1
                    last = backwards_left[a.stage] == 0
                    if stage.is_last:
                        loss = mb_losses[mb] / m if self.scale_grads else mb_losses[mb]
                        mb_losses[mb] = mb_losses[mb].detach()
                        stage.backward_one(mb, loss=loss, last_backward=last)
                    else:
                        grads = comm.wait_recv(Action(a.stage, RECV_B, mb))
                        stage.backward_one(mb, grad_outputs=grads, last_backward=last)
                elif a.type == BACKWARD_INPUT:
                    if stage.is_last:
                        loss = mb_losses[mb] / m if self.scale_grads else mb_losses[mb]
                        mb_losses[mb] = mb_losses[mb].detach()
                        stage.backward_input(mb, loss=loss)
                    else:
                        stage.backward_input(mb, grad_outputs=comm.wait_recv(Action(a.stage, RECV_B, mb)))
                elif a.type == BACKWARD_WEIGHT:
                    stage.backward_weight(mb)
                if timeline is not None and a.type in (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT):
                    timeline.append((a, t0, time.perf_counter()))
            for s in self._stages.values():
                s.flush_weight_grads(force=True)
            comm.finish()
        except BaseException:
            if self._poster is not None:  # what the failed step gave the poster is not posted any more
                self._poster.abandon()
            raise
        if not outputs:
            return None
        if losses is not None:
            losses.extend(mb_losses[i].detach() for i in range(m) if i in mb_losses)
        for s in self._stages.values():
            if s.is_last:
                s.output_chunks = [outputs[i] for i in range(m)]
        if not return_outputs:
            return None
        return _merge([outputs[i] for i in range(m)])


def _detached(value):
    return torch.utils._pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, value)


def _merge(chunks):
    first = chunks[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(chunks, dim=0)
    if isinstance(first, (tuple, list)):
        return type(first)(_merge([c[i] for c in chunks]) for i in range(len(first)))
    if isinstance(first, dict):
        return {k: _merge([c[k] for c in chunks]) for k in first}
    return chunks


class PipelineScheduleSingle(_PipelineSchedule):
    """Base of the schedules with one stage per rank (stage s on group rank s)."""

    def __init__(self, stage, n_microbatches, loss_fn=None, args_chunk_spec=None, kwargs_chunk_spec=None,
                 output_merge_spec=None, scale_grads=True):
        if not isinstance(stage, PipelineStage):
            raise TypeError(f"{type(self).__name__}: stage must be a PipelineStage, got {type(stage).__name__}")
        super().__init__([stage], n_microbatches, loss_fn, scale_grads,
                         (args_chunk_spec, kwargs_chunk_spec, output_merge_spec))
        self._stage = stage

    def _compute_order(self, with_backward):
        if not with_backward:
            return _orders.forward_only(self._num_ranks, self._n_microbatches)
        return self._order(self._num_ranks, self._n_microbatches)


class ScheduleGPipe(PipelineScheduleSingle):
    """GPipe: all forwards, then all backwards. Keeps every micro-batch's activations until its backward."""

    _order = staticmethod(_orders.gpipe)


class Schedule1F1B(PipelineScheduleSingle):
    """1F1B: after a warm-up, one forward then one backward; at most num_stages micro-batches' activations alive."""

    _order = staticmethod(_orders.one_f_one_b)


class PipelineScheduleMulti(_PipelineSchedule):
    """Base of the schedules with several stages per rank (stage s on group rank s % group size)."""

    def __init__(self, stages, n_microbatches, loss_fn=None, args_chunk_spec=None, kwargs_chunk_spec=None,
                 output_merge_spec=None, scale_grads=True):
        stages = list(stages) if isinstance(stages, (list, tuple)) else [stages]
        super().__init__(stages, n_microbatches, loss_fn, scale_grads,
                         (args_chunk_spec, kwargs_chunk_spec, output_merge_spec))

    def _stages_per_rank(self):
        return len(self._stages)


class ScheduleInterleaved1F1B(PipelineScheduleMulti):
    """Interleaved 1F1B (Megatron-LM): v looped stages per rank shrink the bubble about v-fold.

    Needs ``n_microbatches`` to be a multiple of the group size.
    """

    def _compute_order(self, with_backward):
        p, v, m = self._num_ranks, self._stages_per_rank(), self._n_microbatches
        if not with_backward:
            return _orders.forward_only(p, m, v)
        return _orders.interleaved_1f1b(p, m, v)
