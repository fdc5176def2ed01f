"""Lowering: insert the sends and receives that a compute order implies.

For every compute action the rank issues its send right after computing, and posts the receive
it consumes either one compute action ahead (``prefetch=True``: the transfer can overlap the
current computation on a backend that moves data only into a posted receive) or right before its
consumer (``prefetch=False``: as torch.distributed.pipelining does; on tdx the sender's message
already waits in the shared-memory ring, and a receive posted early keeps tdx's progress thread
polling for it during the computation, taking CPU time from it; see ``_comm.posts_receives_early``).
Sends and receive postings are asynchronous; the compute action that consumes a receive waits for it.
Stage ``s`` runs on rank ``placement[s]`` (``_orders.loop_placement`` or ``v_placement``).
"""
from ._actions import FORWARD, GRADS_IN, RECV_B, RECV_F, SEND_B, SEND_F, Action

__all__ = ["add_communication", "recv_for", "send_for"]


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


def peer_of(action, placement):
    """(peer group rank, peer stage) of a communication action; ``placement[s]`` is stage s's rank."""
    if action.type in (SEND_F, RECV_B):
        peer_stage = action.stage + 1
    else:
        peer_stage = action.stage - 1
    if not 0 <= peer_stage < len(placement):
        raise ValueError(f"{action} has no peer: stage {peer_stage} is outside 0..{len(placement) - 1}")
    return placement[peer_stage], peer_stage
