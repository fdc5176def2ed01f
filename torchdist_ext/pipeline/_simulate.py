"""Checks a schedule without processes by simulating every rank.

``simulate`` runs all ranks' action lists against each other (sends and receive postings never
block; a compute action waits for the send that feeds it) and raises ``ScheduleError`` naming the
offending actions when:

- a rank runs a stage that does not live on it, or a compute action is missing or repeated (every
  micro-batch of a stage needs one ``F`` and either one ``B`` or one ``I`` and one ``W``);
- a micro-batch's backward comes before its forward on a stage, a ``W`` before its ``I``, or a
  forward before the forward of the previous stage on the same micro-batch;
- a send has no matching receive (or the reverse), or messages of one flow (same sender, receiver
  stage and direction) are received in a different order than they were sent;
- the ranks wait on each other in a cycle (no rank can make progress).

It also returns, per rank, the largest number of micro-batches whose activations are alive at
once (forward done, backward or ``W`` not yet), and a timeline of every compute action (unit costs
by default: forward 1, backward 2, ``I`` and ``W`` 1 each; or the costs a ``cost`` function gives,
e.g. measured ones) from which the bubble fraction follows. Communication is taken as free. The
runtime calls it once per schedule, so a bad schedule fails before any message is sent.
"""
from collections import defaultdict
from dataclasses import dataclass, field

from ._actions import (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, COMPUTE, FORWARD, GRADS_IN, RECV_B, RECV_F,
                       SEND_B, SEND_F)
from ._lower import peer_of, recv_for, send_for

__all__ = ["ScheduleError", "SimulationResult", "simulate"]


class ScheduleError(ValueError):
    """A schedule is inconsistent; the message names the rank and actions at fault."""


@dataclass
class SimulationResult:
    max_alive: dict = field(default_factory=dict)
    """rank -> most micro-batches with activations alive at once (summed over the rank's stages)."""
    busy: dict = field(default_factory=dict)
    """rank -> total compute time (unit costs)."""
    makespan: float = 0.0
    """time at which the last rank finishes."""
    timeline: dict = field(default_factory=dict)
    """rank -> [(action, start, end), ...] of its compute actions."""

    @property
    def bubble_fraction(self):
        """Idle share of the ranks' time: 1 - sum(busy) / (ranks x makespan)."""
        if not self.busy or self.makespan == 0:
            return 0.0
        return 1.0 - sum(self.busy.values()) / (len(self.busy) * self.makespan)


def _flow(action, placement, rank):
    """(sender rank, receiver rank, receiver stage, direction) of a communication action."""
    peer, peer_stage = peer_of(action, placement)
    if action.type in (SEND_F, SEND_B):
        return rank, peer, peer_stage, action.type == SEND_F
    return peer, rank, action.stage, action.type == RECV_F


def simulate(actions_by_rank, num_stages, n_microbatches, num_ranks=None, with_backward=True,
             forward_cost=1.0, backward_cost=2.0, placement=None, cost=None):
    """Checks a schedule (see the module doc) and plays it; returns a :class:`SimulationResult`.

    placement: ``placement[s]`` is the rank of stage s (default: looped, s % num_ranks).
    cost: optional function ``(rank, action) -> duration`` of a compute action; by default forward
        ``forward_cost``, backward ``backward_cost``, ``I`` and ``W`` half of ``backward_cost`` each.
    """
    num_ranks = len(actions_by_rank) if num_ranks is None else num_ranks
    if placement is None:
        placement = tuple(s % num_ranks for s in range(num_stages))
    placement = tuple(placement)
    if len(placement) != num_stages:
        raise ScheduleError(f"placement {placement} names {len(placement)} stages, expected {num_stages}")
    if sorted(actions_by_rank) != list(range(num_ranks)):
        raise ScheduleError(f"schedule has ranks {sorted(actions_by_rank)}, expected 0..{num_ranks - 1}")
    if cost is None:
        unit = {FORWARD: forward_cost, BACKWARD: backward_cost, BACKWARD_INPUT: backward_cost / 2,
                BACKWARD_WEIGHT: backward_cost / 2}

        def cost(_rank, a):
            return unit[a.type]
    _check_static(actions_by_rank, num_stages, n_microbatches, placement, with_backward)
    max_alive, busy, clock, timeline = _run(actions_by_rank, placement, with_backward, cost)
    return SimulationResult(max_alive=max_alive, busy=busy, makespan=max(clock.values()), timeline=timeline)


def _check_static(actions_by_rank, num_stages, n_microbatches, placement, with_backward):
    """Placement, completeness, each compute's receive before it and send after it, matched flows."""
    seen = defaultdict(list)
    sends, recvs = defaultdict(list), defaultdict(list)  # flow -> [microbatch, ...] in program order
    for rank, acts in actions_by_rank.items():
        for i, a in enumerate(acts):
            if not 0 <= a.stage < num_stages or not 0 <= a.microbatch < n_microbatches:
                raise ScheduleError(f"rank {rank}: action {a} (position {i}) is outside stages 0..{num_stages - 1} "
                                    f"or micro-batches 0..{n_microbatches - 1}")
            if placement[a.stage] != rank:
                raise ScheduleError(f"rank {rank}: action {a} (position {i}) runs stage {a.stage}, which lives on "
                                    f"rank {placement[a.stage]}")
            if a.type in COMPUTE:
                seen[(a.stage, a.type, a.microbatch)].append(i)
                r = recv_for(a, num_stages)
                if r is not None and r not in acts[:i]:
                    raise ScheduleError(f"rank {rank}: {a} consumes {r}, which is not posted before it")
                s = send_for(a, num_stages)
                if s is not None and s not in acts[i + 1:]:
                    raise ScheduleError(f"rank {rank}: {a} produces {s}, which never follows it")
            else:
                flow = _flow(a, placement, rank)
                (sends if a.type in (SEND_F, SEND_B) else recvs)[flow].append((a.microbatch, rank, str(a)))
    for s in range(num_stages):
        for mb in range(n_microbatches):
            count = {k: len(seen.get((s, k, mb), [])) for k in COMPUTE}
            split = count[BACKWARD_INPUT] or count[BACKWARD_WEIGHT]
            wanted = {k: 0 for k in COMPUTE}
            wanted[FORWARD] = 1
            if with_backward:
                wanted[BACKWARD_INPUT if split else BACKWARD] = 1
                wanted[BACKWARD_WEIGHT] = 1 if split else 0
            for k in COMPUTE:
                if count[k] != wanted[k]:
                    raise ScheduleError(f"stage {s} runs {k.value} of micro-batch {mb} {count[k]} times (expected "
                                        f"{wanted[k]}) on rank {placement[s]}" +
                                        ("; a micro-batch's backward is either one B or one I and one W" if
                                         with_backward and k != FORWARD else ""))
    for (s, k, mb), where in seen.items():
        before = {BACKWARD: FORWARD, BACKWARD_INPUT: FORWARD, BACKWARD_WEIGHT: BACKWARD_INPUT}.get(k)
        if before is not None and seen[(s, before, mb)][0] > where[0]:
            what = "its forward" if before == FORWARD else "its I"
            raise ScheduleError(f"rank {placement[s]}: {s}{k.value}{mb} (position {where[0]}) runs before {what} "
                                f"{s}{before.value}{mb} (position {seen[(s, before, mb)][0]})")
    for flow in set(sends) | set(recvs):
        s_mbs = [m for m, _, _ in sends.get(flow, [])]
        r_mbs = [m for m, _, _ in recvs.get(flow, [])]
        src, dst, dst_stage, fwd = flow
        what = f"{'activations' if fwd else 'gradients'} from rank {src} to stage {dst_stage} on rank {dst}"
        if sorted(s_mbs) != sorted(r_mbs):
            raise ScheduleError(f"{what}: sends for micro-batches {s_mbs} but receives for {r_mbs}; every send "
                                "needs exactly one receive")
        if s_mbs != r_mbs:
            raise ScheduleError(f"{what}: sent in micro-batch order {s_mbs} but received in order {r_mbs}")


def _run(actions_by_rank, placement, with_backward, cost):
    """Ranks advance while they can; a compute waits for the send feeding it. Returns
    (max_alive, busy, clock, timeline) per rank; raises ScheduleError on a cycle of waits."""
    num_stages, num_ranks = len(placement), len(actions_by_rank)
    timeline = {r: [] for r in range(num_ranks)}
    sent_at = {}  # (flow, microbatch) -> time the sender issued it
    pos = {r: 0 for r in range(num_ranks)}
    clock = {r: 0.0 for r in range(num_ranks)}
    busy = {r: 0.0 for r in range(num_ranks)}
    alive = {r: 0 for r in range(num_ranks)}
    max_alive = {r: 0 for r in range(num_ranks)}
    done = set()  # (stage, type, microbatch)
    while True:
        progressed = False
        for rank in range(num_ranks):
            acts = actions_by_rank[rank]
            while pos[rank] < len(acts):
                a = acts[pos[rank]]
                if a.type in (SEND_F, SEND_B):
                    sent_at[(_flow(a, placement, rank), a.microbatch)] = clock[rank]
                elif a.type in (RECV_F, RECV_B):
                    pass
                else:
                    start = clock[rank]
                    r = recv_for(a, num_stages)
                    if r is not None:
                        key = (_flow(r, placement, rank), a.microbatch)
                        if key not in sent_at:
                            break  # blocked on a peer
                        start = max(start, sent_at[key])
                    if a.type == FORWARD and a.stage > 0 and (a.stage - 1, FORWARD, a.microbatch) not in done:
                        if placement[a.stage - 1] == rank:
                            raise ScheduleError(f"rank {rank}: {a} runs before {a.stage - 1}F{a.microbatch}, "
                                                "whose output it consumes")
                        break
                    if a.type in GRADS_IN and (a.stage, FORWARD, a.microbatch) not in done:
                        raise ScheduleError(f"rank {rank}: {a} runs before its forward {a.stage}F{a.microbatch}")
                    if a.type == BACKWARD_WEIGHT and (a.stage, BACKWARD_INPUT, a.microbatch) not in done:
                        raise ScheduleError(f"rank {rank}: {a} runs before {a.stage}I{a.microbatch}")
                    if a.type in (BACKWARD, BACKWARD_WEIGHT):
                        alive[rank] -= 1
                    elif a.type == FORWARD:
                        alive[rank] += with_backward
                        max_alive[rank] = max(max_alive[rank], alive[rank])
                    c = cost(rank, a)
                    clock[rank] = start + c
                    busy[rank] += c
                    timeline[rank].append((a, start, start + c))
                    done.add((a.stage, a.type, a.microbatch))
                pos[rank] += 1
                progressed = True
        if all(pos[r] == len(actions_by_rank[r]) for r in range(num_ranks)):
            break
        if not progressed:
            waits = []
            for r in range(num_ranks):
                if pos[r] < len(actions_by_rank[r]):
                    a = actions_by_rank[r][pos[r]]
                    waits.append(f"rank {r} at {a} (position {pos[r]}) waits for "
                                 f"{recv_for(a, num_stages) or 'the previous stage'}")
            raise ScheduleError("the ranks wait on each other in a cycle (deadlock): " + "; ".join(waits))
    return max_alive, busy, clock, timeline
