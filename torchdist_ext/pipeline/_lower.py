"""Lowering: insert the sends and receives that a compute order implies.

For every compute action the rank issues its send right after computing, and posts the receive
it consumes either one compute action ahead (``prefetch=True``: the transfer can overlap the
current computation on a backend that moves data only into a posted receive) or right before its
consumer (``prefetch=False``: as torch.distributed.pipelining does; on tdx the sender's message
already waits in the shared-memory ring, and a receive posted early keeps tdx's progress thread
polling for it during the computation, taking CPU time from it; see ``_comm.posts_receives_early``).
Sends and receive postings are asynchronous; the compute action that consumes a receive waits for it.
Stage ``s`` runs on rank ``placement[s]`` (``_orders.loop_placement`` or ``v_placement``).

``post_at_producer`` moves early receives further up, to where the schedule's simulated timeline
says the sender starts the computation whose result the receive takes: on a backend that moves a
message only into a posted receive (Gloo), a receive posted after its message was sent costs two
more trips between the ranks' progress threads before the data moves, and one compute action
ahead is often too late when the sender runs ahead (a V schedule's first stage, the warm-up).
"""
from ._actions import FORWARD, GRADS_IN, RECVS, RECV_B, RECV_F, SEND_B, SEND_F, Action

__all__ = ["add_communication", "post_at_producer", "recv_for", "send_for"]


def recv_for(action, num_stages):
    """The receive a compute action consumes, or None (first stage's forward, last stage's backward,
    a weight-gradient ``W``)."""
    if action.type == FORWARD and action.stage > 0:
        return Action(action.stage, RECV_F, action.microbatch)
    if action.type in GRADS_IN and action.stage < num_stages - 1:
        return Action(action.stage, RECV_B, action.microbatch)
    return None


def send_for(action, num_stages):
    """The send a compute action produces, or None (last stage's forward, first stage's backward, ``W``)."""
    if action.type == FORWARD and action.stage < num_stages - 1:
        return Action(action.stage, SEND_F, action.microbatch)
    if action.type in GRADS_IN and action.stage > 0:
        return Action(action.stage, SEND_B, action.microbatch)
    return None


def add_communication(compute_by_rank, num_stages, prefetch=True):
    """``{rank: compute actions}`` -> ``{rank: actions with SEND_*/RECV_* inserted}``.

    prefetch: post the receive of compute action i + 1 before running compute action i (True),
        or right before its consumer (False).
    """
    out = {}
    for rank, compute in compute_by_rank.items():
        acts = []
        recvs = [recv_for(a, num_stages) for a in compute]
        if prefetch and recvs and recvs[0] is not None:
            acts.append(recvs[0])
        for i, a in enumerate(compute):
            if prefetch:
                if i + 1 < len(compute) and recvs[i + 1] is not None:
                    acts.append(recvs[i + 1])
            elif recvs[i] is not None:
                acts.append(recvs[i])
            acts.append(a)
            s = send_for(a, num_stages)
            if s is not None:
                acts.append(s)
        out[rank] = acts
    return out


def _producers(recv):
    """The compute actions whose result ``recv`` takes (a backward gradient: the ``B`` or the ``I``)."""
    if recv.type == RECV_F:
        return [Action(recv.stage - 1, FORWARD, recv.microbatch)]
    return [Action(recv.stage + 1, t, recv.microbatch) for t in GRADS_IN]


def post_at_producer(actions_by_rank, timeline):
    """Moves every receive up to the first compute action of its rank that is still running, in the
    simulated ``timeline`` ({rank: [(compute action, start, end), ...]}, ``simulate``'s), when the
    sender starts the computation that produces it; never later than where it was. Receives keep
    the order of their flow (a stage's activations, or its gradients, in the order they are sent);
    sends stay right after their compute action. Returns the new ``{rank: actions}``.
    """
    start = {a: t0 for spans in timeline.values() for a, t0, _ in spans}
    out = {}
    for rank, acts in actions_by_rank.items():
        ends = [t1 for _, _, t1 in timeline[rank]]
        before = [[] for _ in range(len(ends) + 1)]  # receives to post before compute action i
        latest, k = {}, 0  # latest: flow -> where its last receive went; k: compute actions seen so far
        for a in acts:
            if a.type in RECVS:
                t = min((start[p] for p in _producers(a) if p in start), default=None)
                slot = k if t is None else next((i for i, e in enumerate(ends) if e > t), k)
                # never later than now, never ahead of the flow's previous receive
                slot = latest[(a.stage, a.type)] = max(latest.get((a.stage, a.type), 0), min(slot, k))
                before[slot].append(a)
            elif a.type not in (SEND_F, SEND_B):
                k += 1
        new, k = [], 0
        for a in acts:
            if a.type in RECVS:
                continue
            if a.type not in (SEND_F, SEND_B):
                new.extend(before[k])
                k += 1
            new.append(a)
        new.extend(before[k])
        out[rank] = new
    return out


def peer_of(action, placement):
    """(peer group rank, peer stage) of a communication action; ``placement[s]`` is stage s's rank."""
    if action.type in (SEND_F, RECV_B):
        peer_stage = action.stage + 1
    else:
        peer_stage = action.stage - 1
    if not 0 <= peer_stage < len(placement):
        raise ValueError(f"{action} has no peer: stage {peer_stage} is outside 0..{len(placement) - 1}")
    return placement[peer_stage], peer_stage
