"""Zero-bubble compute orders: the backward split into ``I`` (input gradient) and ``W`` (weight
gradients), the ``W`` actions placed where a rank would otherwise wait.

- ``zb_h1`` (Qi et al., "Zero Bubble Pipeline Parallelism", ZB-H1): one stage per rank, the 1F1B
  order with every backward split; rank r keeps up to ``p - 1 - r`` weight gradients pending and
  runs them in the cool-down, where 1F1B waits. Same activation memory as 1F1B, a third of its
  bubble when F, I and W take equal time.
- ``zbv`` (the same paper, ZB-V): two stages per rank in a V (rank r holds stages r and 2p-1-r);
  the order torch.distributed.pipelining's ``ScheduleZBVZeroBubble`` runs.
- ``dualpipev`` (DeepSeek-V3's DualPipe folded into a V, as torch's ``ScheduleDualPipeV``): two
  stages per rank in a V, a forward of one stage paired with a backward of the other in the
  steady state, the second half of the cool-down split into ``I``/``W``.
- ``fill_weights``: any order with ``B`` actions turned into ``I`` plus a ``W`` placed where the
  rank would wait (ZB-H1 is 1F1B through it, the interleaved zero-bubble schedule interleaved 1F1B).
"""
from ._actions import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, Action
from ._orders import interleaved_1f1b, one_f_one_b

__all__ = ["zb_h1", "zbv", "dualpipev", "fill_weights", "interleaved_zero_bubble"]


def fill_weights(order, placement, keep, forward_cost=1.0, input_cost=1.0, weight_cost=1.0, fill_early=False):
    """Splits every ``B`` of ``order`` into ``I`` and a ``W`` placed greedily: the ranks are played
    against each other with the given costs (communication free), keeping each rank's order of ``F``
    and ``I``; a rank runs its oldest pending ``W`` once more than ``keep[rank]`` are pending
    (bounding the memory they hold), and, when its next ``F``/``I`` cannot start yet (its input has
    not arrived), in the cool-down (no forward left; with ``fill_early`` at any time). Whatever is
    pending at the end runs last.
    Returns {rank: compute actions with I and W}."""
    cost = {FORWARD: forward_cost, BACKWARD_INPUT: input_cost, BACKWARD_WEIGHT: weight_cost}
    seq = {r: [Action(a.stage, BACKWARD_INPUT, a.microbatch) if a.type == BACKWARD else a for a in acts]
           for r, acts in order.items()}
    num_stages = len(placement)
    pos = {r: 0 for r in seq}
    clock = {r: 0.0 for r in seq}
    pending = {r: [] for r in seq}
    fwd_left = {r: sum(a.type == FORWARD for a in acts) for r, acts in seq.items()}
    done_at = {}  # (stage, F|I, microbatch) -> end time
    out = {r: [] for r in seq}

    def ready_at(a):
        """When a's input is there: None if its producer has not run yet."""
        if a.type == FORWARD:
            dep = (a.stage - 1, FORWARD, a.microbatch) if a.stage > 0 else None
        else:
            dep = (a.stage + 1, BACKWARD_INPUT, a.microbatch) if a.stage < num_stages - 1 else None
        own = (a.stage, FORWARD, a.microbatch) if a.type == BACKWARD_INPUT else None
        times = [done_at.get(d) for d in (dep, own) if d is not None]
        return None if any(t is None for t in times) else max(times, default=0.0)

    def run(r, a, start):
        out[r].append(a)
        clock[r] = start + cost[a.type]
        if a.type != BACKWARD_WEIGHT:
            done_at[(a.stage, a.type, a.microbatch)] = clock[r]

    while any(pos[r] < len(seq[r]) for r in seq):
        # the lowest-clock rank that can act: every action ending before its clock is known by then
        # (lower-clock ranks wait for inputs that only later actions produce)
        live = sorted((clock[q], q) for q in seq if pos[q] < len(seq[q]))
        for _, r in live:
            a = seq[r][pos[r]]
            t = ready_at(a)
            waits = t is None or t > clock[r]
            weight = bool(pending[r]) and (len(pending[r]) > keep[r] or (waits and (fill_early or fwd_left[r] == 0)))
            if t is not None or weight:
                break
        else:
            raise ValueError(f"fill_weights: the order deadlocks: {[(q, str(seq[q][pos[q]])) for _, q in live]}")
        if weight:
            run(r, pending[r].pop(0), clock[r])
            continue
        run(r, a, max(t, clock[r]))
        pos[r] += 1
        fwd_left[r] -= a.type == FORWARD
        if a.type == BACKWARD_INPUT:
            pending[r].append(Action(a.stage, BACKWARD_WEIGHT, a.microbatch))
    for r in seq:
        out[r] += pending[r]
    return out


def zb_h1(num_ranks, n_microbatches):
    """ZB-H1: the 1F1B order of forwards and input gradients, weight gradients filling the waits;
    rank r keeps at most ``p - 1 - r`` of them pending (1F1B's activation memory bound)."""
    p = num_ranks
    return fill_weights(one_f_one_b(p, n_microbatches), tuple(range(p)), {r: r for r in range(p)}, fill_early=True)


def interleaved_zero_bubble(num_ranks, n_microbatches, stages_per_rank):
    """Interleaved 1F1B with split backwards, each rank delaying its W like ZB-H1 does."""
    p = num_ranks
    if stages_per_rank == 1:
        return zb_h1(p, n_microbatches)
    order = interleaved_1f1b(p, n_microbatches, stages_per_rank)
    return fill_weights(order, tuple(s % p for s in range(p * stages_per_rank)), {r: p - 1 - r for r in range(p)})


class _Counter:
    """Per-rank order builder: the next micro-batch of each (stage, kind), and the W queue."""

    def __init__(self):
        self.next = {}
        self.acts = []
        self.weights = []  # W actions owed by I actions, oldest first

    def add(self, stage, kind):
        key = (stage, BACKWARD_INPUT if kind == BACKWARD else kind)  # B and I share micro-batch numbers
        mb = self.next.get(key, 0)
        self.next[key] = mb + 1
        self.acts.append(Action(stage, kind, mb))
        if kind == BACKWARD_INPUT:
            self.weights.append(Action(stage, BACKWARD_WEIGHT, mb))

    def weight(self):
        if self.weights:
            self.acts.append(self.weights.pop(0))


def zbv(num_ranks, n_microbatches):
    """ZB-V (Qi et al., section 6): rank r holds stages r and 2p-1-r; warm-up forwards of the first
    stage, then of both, then I and W of the second right after its forward; a steady state of
    ``F I W`` on each of the two stages; a cool-down of input gradients with the weight gradients
    after them. Orders for fewer than 2p-1 micro-batches are the 2p-1 order with the missing
    micro-batches left out. Returns {rank: compute actions}."""
    p, m = num_ranks, n_microbatches
    n = max(2 * p - 1, m)
    out = {}
    for r in range(p):
        down, up = r, 2 * p - 1 - r
        b = _Counter()
        for _ in range(2 * (p - r) - 1):
            b.add(down, FORWARD)
        for _ in range(r):
            b.add(up, FORWARD)
            b.add(down, FORWARD)
        for _ in range(p - r):
            b.add(up, FORWARD)
            b.add(up, BACKWARD_INPUT)
            b.add(up, BACKWARD_WEIGHT)
        while b.next.get((up, FORWARD), 0) < b.next[(down, FORWARD)] or b.next[(down, FORWARD)] < n:
            if b.next[(down, FORWARD)] < n:
                b.add(down, FORWARD)
            b.add(down, BACKWARD_INPUT)
            b.add(down, BACKWARD_WEIGHT)
            b.add(up, FORWARD)
            b.add(up, BACKWARD_INPUT)
            b.add(up, BACKWARD_WEIGHT)
        # W actions above were added with their own counters; the cool-down keeps W after its I
        owed = {s: b.next.get((s, BACKWARD_INPUT), 0) for s in (down, up)}
        for _ in range(r):
            b.add(down, BACKWARD_INPUT)
            b.add(up, BACKWARD_INPUT)
        for _ in range(p - r):
            b.add(down, BACKWARD_INPUT)
            b.acts.append(Action(down, BACKWARD_WEIGHT, owed[down]))
            owed[down] += 1
        for s in (up, down):
            while owed[s] < b.next[(s, BACKWARD_INPUT)]:
                b.acts.append(Action(s, BACKWARD_WEIGHT, owed[s]))
                owed[s] += 1
        out[r] = [a for a in b.acts if a.microbatch < m]
    return out


def dualpipev(num_ranks, n_microbatches):
    """DualPipeV (DeepSeek-V3's DualPipe folded into a V, as torch's ScheduleDualPipeV): rank r holds
    stages r and 2p-1-r; after the warm-up, each forward of one stage is paired with a backward of
    the other (run one after the other here: the pair overlaps communication with computation
    only with a runtime that splits them into streams), and the cool-down's second half splits
    backwards into I and W to fill the drain. Needs ``n_microbatches >= 2 * num_ranks``."""
    p, m = num_ranks, n_microbatches
    if m < 2 * p:
        raise ValueError(f"DualPipeV needs at least as many micro-batches as stages (2 x {p} ranks = {2 * p}); got "
                         f"n_microbatches={m}")
    out = {}
    for r in range(p):
        s0, s1 = r, 2 * p - 1 - r
        b = _Counter()
        b.weights = []
        for _ in range(2 * (p - r - 1)):
            b.add(s0, FORWARD)
        for _ in range(r + 1):
            b.add(s0, FORWARD)
            b.add(s1, FORWARD)
        for _ in range(p - r - 1):
            b.add(s1, BACKWARD_INPUT)
            b.weight()
            b.add(s1, FORWARD)
        for _ in range(m - 2 * p + r + 1):
            b.add(s0, FORWARD)
            b.add(s1, BACKWARD)
            b.add(s1, FORWARD)
            b.add(s0, BACKWARD)
        for _ in range(p - r - 1):
            b.add(s1, BACKWARD)
            b.add(s1, FORWARD)
            b.add(s0, BACKWARD)
        split = False
        half = (r + 1) // 2
        for i in range(r + 1):
            if i == half and r % 2 == 1:
                split = True
            b.add(s1, BACKWARD_INPUT if split else BACKWARD)
            if i == half and r % 2 == 0:
                split = True
            b.add(s0, BACKWARD_INPUT if split else BACKWARD)
        for _ in range(p - r - 1):
            b.weight()
            b.add(s0, BACKWARD_INPUT if split else BACKWARD)
        for _ in range(r + 1):
            b.weight()
        while b.weights:
            b.weight()
        out[r] = b.acts
    return out
