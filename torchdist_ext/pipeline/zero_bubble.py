"""Zero-bubble schedules: the backward split into input gradients (``I``) and weight gradients (``W``).

Torch's class names and arguments (``torch.distributed.pipelining``)::

    stages = [PipelineStage(parts[s], s, 2 * world, "cpu") for s in (rank, 2 * world - 1 - rank)]
    schedule = ScheduleZBVZeroBubble(stages, n_microbatches=8, loss_fn=F.cross_entropy)
    schedule.step(x)  /  schedule.step(target=y, losses=losses)   # rank 0 holds the first and the last stage

- ``ScheduleInterleavedZeroBubble``: with one stage per rank, ZB-H1 (Qi et al.): 1F1B's order of
  forwards and input gradients, the weight gradients filling the waits; 1F1B's activation memory,
  a third of its bubble when F, I and W cost the same. With several looped stages per rank, the
  interleaved 1F1B order split the same way.
- ``ScheduleZBVZeroBubble``: ZB-V, two stages per rank in a V (rank r: stages r and 2p-1-r).
- ``ScheduleDualPipeV``: DeepSeek-V3's DualPipe folded into a V, two stages per rank.
- ``ScheduleCustom``: any schedule given as text, one line per rank of the action tokens
  (``rank 0: 0F0 0F1 0I0 0W0 ...``), stages placed where the text puts them.

The split works for any module (see ``_backward.py``), with ``torch.utils.checkpoint(...,
use_reentrant=False)`` inside. ``schedule.simulate()`` says a schedule's bubble.
"""
from . import _orders, _zb_orders
from ._actions import COMPUTE, Action, parse_schedule
from ._simulate import ScheduleError
from .schedules import PipelineScheduleMulti

__all__ = ["ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV", "ScheduleCustom"]


class ScheduleInterleavedZeroBubble(PipelineScheduleMulti):
    """ZB-H1 with one stage per rank; with v looped stages per rank (stage s on rank s % p), the
    interleaved 1F1B order with split backwards (``n_microbatches`` a multiple of the group size)."""

    def _compute_order(self, with_backward):
        p, v, m = self._num_ranks, self._stages_per_rank(), self._n_microbatches
        if not with_backward:
            return _orders.forward_only(p, m, v)
        return _zb_orders.interleaved_zero_bubble(p, m, v)


class _VSchedule(PipelineScheduleMulti):
    """Two stages per rank in a V: rank r holds stages r and 2p-1-r."""

    def __init__(self, stages, n_microbatches, loss_fn=None, args_chunk_spec=None, kwargs_chunk_spec=None,
                 output_merge_spec=None, scale_grads=True):
        stages = list(stages) if isinstance(stages, (list, tuple)) else [stages]
        if len(stages) != 2:
            raise ValueError(f"{type(self).__name__} runs exactly 2 stages per rank (rank r: stages r and "
                             f"2 x group size - 1 - r); got {len(stages)} stage(s)")
        super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads)

    def _placement(self):
        return _orders.v_placement(self._num_ranks)

    def _layout_rule(self):
        return f"group rank r holds stages r and {2 * self._num_ranks - 1} - r"

    def _compute_order(self, with_backward):
        if not with_backward:
            return _orders.forward_only_placed(self._placement(), self._n_microbatches)
        return self._order(self._num_ranks, self._n_microbatches)


class ScheduleZBVZeroBubble(_VSchedule):
    """ZB-V (Qi et al., section 6): zero bubble when F, I and W take equal time; torch's order."""

    _order = staticmethod(_zb_orders.zbv)


class ScheduleDualPipeV(_VSchedule):
    """DualPipeV (DeepSeek-V3's DualPipe in a V; torch's order). Needs ``n_microbatches`` >= the
    number of stages (2 x group size)."""

    _order = staticmethod(_zb_orders.dualpipev)

    def __init__(self, stages, n_microbatches, loss_fn=None, args_chunk_spec=None, kwargs_chunk_spec=None,
                 output_merge_spec=None, scale_grads=True):
        super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads)
        num_stages = 2 * self._num_ranks
        if isinstance(n_microbatches, int) and n_microbatches < num_stages:
            raise ValueError(f"ScheduleDualPipeV needs at least as many micro-batches as stages: n_microbatches="
                             f"{n_microbatches} < {num_stages} stages; use n_microbatches >= {num_stages}")


class ScheduleCustom(PipelineScheduleMulti):
    """A schedule given as data: ``schedule`` is text, one line per rank (``format_schedule``'s form,
    e.g. ``"rank 0: 0F0 0F1 0I0 0W0 0I1 0W1\\nrank 1: 1F0 1I0 1F1 1I1 1W0 1W1"``), or
    ``{rank: [Action or token, ...]}``.

    Compute tokens only (``F``, ``B``, ``I``, ``W``): sends and receives are inserted as for the
    built-in schedules. A micro-batch's backward on a stage is one ``B`` or one ``I`` then one ``W``.
    A stage runs on the rank whose line names it; every rank passes the stages its line names.
    The schedule is checked once, without processes (``simulate``): each compute action once, no
    backward before its forward, no cycle of waits; ``ScheduleError`` names the actions at fault.
    """

    def __init__(self, stages, n_microbatches, loss_fn=None, args_chunk_spec=None, kwargs_chunk_spec=None,
                 output_merge_spec=None, scale_grads=True, *, schedule):
        super().__init__(stages, n_microbatches, loss_fn, args_chunk_spec, kwargs_chunk_spec, output_merge_spec,
                         scale_grads)
        self._given = _parse_custom(schedule, self._num_ranks, self._num_stages)

    def _placement(self):
        where = {}
        for r, acts in self._given.items():
            for a in acts:
                if where.setdefault(a.stage, r) != r:
                    raise ScheduleError(f"ScheduleCustom: stage {a.stage} appears on rank {where[a.stage]} and on "
                                        f"rank {r}; a stage runs on one rank")
        missing = [s for s in range(self._num_stages) if s not in where]
        if missing:
            raise ScheduleError(f"ScheduleCustom: stages {missing} appear on no rank's line ({self._num_stages} "
                                "stages in all)")
        return tuple(where[s] for s in range(self._num_stages))

    def _layout_rule(self):
        return "the schedule text places each stage"

    def _check_layout(self, num_stages, table):
        return  # any number of stages per rank; the placement check names the stages each rank holds

    def _compute_order(self, with_backward):
        if not with_backward:
            return _orders.forward_only_placed(self._placement(), self._n_microbatches)
        return self._given


def _parse_custom(schedule, num_ranks, num_stages):
    if isinstance(schedule, str):
        given = parse_schedule(schedule)
    elif isinstance(schedule, dict):
        given = {int(r): [a if isinstance(a, Action) else Action.parse(str(a)) for a in acts]
                 for r, acts in schedule.items()}
    else:
        raise TypeError(f"ScheduleCustom: schedule must be text or a dict {{rank: [actions]}}, got "
                        f"{type(schedule).__name__}")
    if sorted(given) != list(range(num_ranks)):
        raise ScheduleError(f"ScheduleCustom: the schedule has lines for ranks {sorted(given)}, but the group has "
                            f"{num_ranks} ranks (0..{num_ranks - 1}); give one line per rank")
    for r, acts in given.items():
        other = [str(a) for a in acts if a.type not in COMPUTE]
        if other:
            raise ScheduleError(f"ScheduleCustom: rank {r} lists communication actions {other[:4]}; give compute "
                                "actions only (F, B, I, W): sends and receives are inserted for you")
        bad = [str(a) for a in acts if a.stage >= num_stages]
        if bad:
            raise ScheduleError(f"ScheduleCustom: rank {r} names stages beyond the pipeline's {num_stages}: {bad[:4]}")
    return given

