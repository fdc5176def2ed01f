"""Compute orders: which forward and backward each rank runs, and in which order, per schedule.

Each function returns ``{rank: [Action(stage, F|B|I|W, microbatch), ...]}`` with compute actions
only; ``_lower.add_communication`` then inserts the sends and receives. Stage placement is a tuple
``placement[s] = rank``: looped (stage ``s`` on rank ``s % num_ranks``: one stage per rank, or
``stages_per_rank`` looped stages per rank for the interleaved schedules, as in Megatron-LM and
torch.distributed.pipelining) or V-shaped (rank r holds stages r and 2p-1-r, so the first and the
last stage share rank 0: ZB-V and DualPipeV). Zero-bubble orders (ZB-H1, ZB-V, DualPipeV) are in
``_zb_orders.py``.
"""
from ._actions import BACKWARD, FORWARD, Action

__all__ = ["gpipe", "one_f_one_b", "interleaved_1f1b", "forward_only", "stage_rank", "loop_placement",
           "v_placement"]


def stage_rank(stage, num_ranks):
    """The group rank that runs ``stage`` in the looped placement (stage ``s`` on rank ``s % num_ranks``)."""
    return stage % num_ranks


def loop_placement(num_ranks, stages_per_rank=1):
    """(rank of stage 0, rank of stage 1, ...): stage s on rank s % num_ranks."""
    return tuple(s % num_ranks for s in range(num_ranks * stages_per_rank))


def v_placement(num_ranks):
    """V shape, two stages per rank: rank r holds stages r and 2 * num_ranks - 1 - r."""
    return tuple(s if s < num_ranks else 2 * num_ranks - 1 - s for s in range(2 * num_ranks))


def _check(num_ranks, n_microbatches, stages_per_rank=1):
    if num_ranks < 1 or n_microbatches < 1 or stages_per_rank < 1:
        raise ValueError(f"schedule needs num_ranks >= 1, n_microbatches >= 1 and stages_per_rank >= 1; got "
                         f"num_ranks={num_ranks}, n_microbatches={n_microbatches}, stages_per_rank={stages_per_rank}")


def gpipe(num_ranks, n_microbatches):
    """GPipe: every forward, then every backward (all micro-batches' activations alive at once)."""
    _check(num_ranks, n_microbatches)
    return {r: [Action(r, FORWARD, i) for i in range(n_microbatches)] +
               [Action(r, BACKWARD, i) for i in range(n_microbatches)] for r in range(num_ranks)}


def forward_only(num_ranks, n_microbatches, stages_per_rank=1):
    """Forward passes only (``eval()``): each rank runs its stages' forwards, micro-batch by micro-batch."""
    _check(num_ranks, n_microbatches, stages_per_rank)
    return {r: [Action(c * num_ranks + r, FORWARD, i) for i in range(n_microbatches) for c in range(stages_per_rank)]
            for r in range(num_ranks)}


def one_f_one_b(num_ranks, n_microbatches):
    """1F1B (PipeDream-flush): rank r runs ``num_ranks - 1 - r`` warm-up forwards, then alternates one
    forward and one backward, then drains the backwards. At most ``num_ranks - r`` micro-batches'
    activations are alive on rank r, independent of the micro-batch count."""
    _check(num_ranks, n_microbatches)
    out = {}
    for r in range(num_ranks):
        warmup = min(num_ranks - 1 - r, n_microbatches)
        acts = [Action(r, FORWARD, i) for i in range(warmup)]
        for i in range(n_microbatches - warmup):
            acts += [Action(r, FORWARD, warmup + i), Action(r, BACKWARD, i)]
        acts += [Action(r, BACKWARD, i) for i in range(n_microbatches - warmup, n_microbatches)]
        out[r] = acts
    return out


def interleaved_1f1b(num_ranks, n_microbatches, stages_per_rank):
    """Interleaved 1F1B (Megatron-LM): rank r holds stages r, r + p, r + 2p, ... (p = num_ranks) and
    walks micro-batches in groups of p through its stages, which shrinks the bubble by the number of
    stages per rank. Needs ``n_microbatches`` to be a multiple of ``num_ranks``."""
    _check(num_ranks, n_microbatches, stages_per_rank)
    p, v, m = num_ranks, stages_per_rank, n_microbatches
    if v == 1:
        return one_f_one_b(p, m)
    if m % p:
        raise ValueError(f"interleaved 1F1B walks micro-batches in groups of num_ranks={p}, so n_microbatches must be "
                         f"a multiple of it; got n_microbatches={m} (use {m + p - m % p} or {max(p, m - m % p)})")
    total = m * v

    def nth(k, backward):
        group, within = divmod(k, p * v)
        chunk = within // p
        if backward:
            chunk = v - 1 - chunk
        return chunk, group * p + within % p

    out = {}
    for r in range(p):
        warmup = min((p - 1 - r) * 2 + (v - 1) * p, total)
        acts = []
        for k in range(warmup):
            c, mb = nth(k, False)
            acts.append(Action(c * p + r, FORWARD, mb))
        for i in range(total - warmup):
            c, mb = nth(warmup + i, False)
            acts.append(Action(c * p + r, FORWARD, mb))
            c, mb = nth(i, True)
            acts.append(Action(c * p + r, BACKWARD, mb))
        for i in range(total - warmup, total):
            c, mb = nth(i, True)
            acts.append(Action(c * p + r, BACKWARD, mb))
        out[r] = acts
    return out


def forward_only_placed(placement, n_microbatches):
    """Forward passes only for any placement: each rank runs its stages in stage order, every
    micro-batch of one stage before the next stage (no cycle of waits for any placement)."""
    out = {r: [] for r in range(max(placement) + 1)}
    for s, r in enumerate(placement):
        out[r] += [Action(s, FORWARD, i) for i in range(n_microbatches)]
    return out
