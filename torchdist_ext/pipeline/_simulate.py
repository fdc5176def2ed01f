"""Checks a schedule without processes by simulating every rank.

``simulate`` runs all ranks' action lists against each other (sends and receive postings never
block; a compute action waits for the send that feeds it) and raises ``ScheduleError`` naming the
offending actions when:

- a rank runs a stage that does not live on it, or a compute action is missing or repeated;
- a micro-batch's backward comes before its forward on a stage, or a forward before the forward
  of the previous stage on the same micro-batch;
- a send has no matching receive (or the reverse), or messages of one flow (same sender, receiver
  stage and direction) are received in a different order than they were sent;
- the ranks wait on each other in a cycle (no rank can make progress).

It also returns, per rank, the largest number of micro-batches whose activations are alive at
once (forward done, backward not yet), and a unit-cost timeline (forward 1, backward 2 by default)
from which the bubble fraction follows. The runtime calls it once per schedule, so a bad schedule
fails before any message is sent.
"""
from collections import defaultdict
from dataclasses import dataclass, field

from ._actions import BACKWARD, FORWARD, RECV_B, RECV_F, SEND_B, SEND_F
from ._lower import peer_of, recv_for, send_for
from ._orders import stage_rank

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

    @property
    def bubble_fraction(self):
        """Idle share of the ranks' time: 1 - sum(busy) / (ranks x makespan)."""
        if not self.busy or self.makespan == 0:
            return 0.0
        return 1.0 - sum(self.busy.values()) / (len(self.busy) * self.makespan)


def _flow(action, num_stages, num_ranks, rank):
    """(sender rank, receiver rank, receiver stage, direction) of a communication action."""
    peer, peer_stage = peer_of(action, num_stages, num_ranks)
    if action.type in (SEND_F, SEND_B):
        return rank, peer, peer_stage, action.type == SEND_F
    return peer, rank, action.stage, action.type == RECV_F


def simulate(actions_by_rank, num_stages, n_microbatches, num_ranks=None, with_backward=True,
             forward_cost=1.0, backward_cost=2.0):
    num_ranks = len(actions_by_rank) if num_ranks is None else num_ranks
    if sorted(actions_by_rank) != list(range(num_ranks)):
        raise ScheduleError(f"schedule has ranks {sorted(actions_by_rank)}, expected 0..{num_ranks - 1}")
    _check_static(actions_by_rank, num_stages, n_microbatches, num_ranks, with_backward)
    max_alive, busy, clock = _run(actions_by_rank, num_stages, num_ranks, with_backward, forward_cost, backward_cost)
    return SimulationResult(max_alive=max_alive, busy=busy, makespan=max(clock.values()))


def _check_static(actions_by_rank, num_stages, n_microbatches, num_ranks, with_backward):
    """Placement, completeness, each compute's receive before it and send after it, matched flows."""
    seen = defaultdict(list)
    sends, recvs = defaultdict(list), defaultdict(list)  # flow -> [microbatch, ...] in program order
    for rank, acts in actions_by_rank.items():
        for i, a in enumerate(acts):
            if not 0 <= a.stage < num_stages or not 0 <= a.microbatch < n_microbatches:
                raise ScheduleError(f"rank {rank}: action {a} (position {i}) is outside stages 0..{num_stages - 1} "
                                    f"or micro-batches 0..{n_microbatches - 1}")
            if stage_rank(a.stage, num_ranks) != rank:
                raise ScheduleError(f"rank {rank}: action {a} (position {i}) runs stage {a.stage}, which lives on "
                                    f"rank {stage_rank(a.stage, num_ranks)}")
            if a.type in (FORWARD, BACKWARD):
                seen[(a.stage, a.type, a.microbatch)].append(i)
                r = recv_for(a, num_stages)
                if r is not None and r not in acts[:i]:
                    raise ScheduleError(f"rank {rank}: {a} consumes {r}, which is not posted before it")
                s = send_for(a, num_stages)
                if s is not None and s not in acts[i + 1:]:
                    raise ScheduleError(f"rank {rank}: {a} produces {s}, which never follows it")
            else:
                flow = _flow(a, num_stages, num_ranks, rank)
                (sends if a.type in (SEND_F, SEND_B) else recvs)[flow].append((a.microbatch, rank, str(a)))
    kinds = (FORWARD, BACKWARD) if with_backward else (FORWARD,)
    for s in range(num_stages):
        for k in kinds:
            for mb in range(n_microbatches):
                where = seen.get((s, k, mb), [])
                if len(where) != 1:
                    raise ScheduleError(f"stage {s} runs {k.value} of micro-batch {mb} {len(where)} times (expected "
                                        f"once) on rank {stage_rank(s, num_ranks)}")
    for (s, k, mb), where in seen.items():
        if k == BACKWARD and seen[(s, FORWARD, mb)][0] > where[0]:
            raise ScheduleError(f"rank {stage_rank(s, num_ranks)}: {s}B{mb} (position {where[0]}) runs before its "
                                f"forward {s}F{mb} (position {seen[(s, FORWARD, mb)][0]})")
    if not with_backward and any(k == BACKWARD for (_, k, _) in seen):
        raise ScheduleError("a forward-only schedule contains backward actions")
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


def _run(actions_by_rank, num_stages, num_ranks, with_backward, forward_cost, backward_cost):
    """Ranks advance while they can; a compute waits for the send feeding it. Returns
    (max_alive, busy, clock) per rank; raises ScheduleError on a cycle of waits."""
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
                    sent_at[(_flow(a, num_stages, num_ranks, rank), a.microbatch)] = clock[rank]
                elif a.type in (RECV_F, RECV_B):
                    pass
                else:
                    start = clock[rank]
                    r = recv_for(a, num_stages)
                    if r is not None:
                        key = (_flow(r, num_stages, num_ranks, rank), a.microbatch)
                        if key not in sent_at:
                            break  # blocked on a peer
                        start = max(start, sent_at[key])
                    if a.type == FORWARD and a.stage > 0 and (a.stage - 1, FORWARD, a.microbatch) not in done:
                        if stage_rank(a.stage - 1, num_ranks) == rank:
                            raise ScheduleError(f"rank {rank}: {a} runs before {a.stage - 1}F{a.microbatch}, "
                                                "whose output it consumes")
                        break
                    if a.type == BACKWARD:
                        if (a.stage, FORWARD, a.microbatch) not in done:
                            raise ScheduleError(f"rank {rank}: {a} runs before its forward "
                                                f"{a.stage}F{a.microbatch}")
                        alive[rank] -= 1
                    else:
                        alive[rank] += with_backward
                        max_alive[rank] = max(max_alive[rank], alive[rank])
                    cost = forward_cost if a.type == FORWARD else backward_cost
                    clock[rank] = start + cost
                    busy[rank] += cost
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
    return max_alive, busy, clock
