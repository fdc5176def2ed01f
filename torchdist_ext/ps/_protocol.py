"""The messages between workers and servers (c10d point-to-point on the default group).

At start each worker and each server exchange a description (length, then the int64 words of
``_layout.describe``) and both refuse a mismatch. Then, per step, a worker sends each server one
PUSH message, a float32 tensor ``[clock, worker rank, 0, 0, gradient shard...]``, which the server
receives from any source; the server answers with one REPLY message
``[updates taken, live workers, slowest clock, 0, parameter shard...]`` (the first REPLY goes out after
the handshake: the initial parameters). A worker that is done sends BYE; a server keeps a receive
for BYE posted from each worker, so a worker that dies fails that receive with the rank's name.
"""
import itertools
from collections import namedtuple

import torch
import torch.distributed as dist

__all__ = []

Tags = namedtuple("Tags", "desc_len desc push reply bye")
_sessions = itertools.count()


def next_tags() -> Tags:
    """The tags of the next server/worker session of this process. Every rank creates its
    ParameterServer or Worker objects in the same order, so the sessions agree; a session's
    leftover receive (a server's last any-source receive) never matches a later session's messages."""
    base = 0x5D00 + 8 * next(_sessions)
    return Tags(*range(base, base + 5))

HEADER = 4  # float32 words before a shard in PUSH and REPLY


def post_description(desc: torch.Tensor, peer: int, tags: Tags):
    """Starts sending our description to ``peer``; returns the works and the length tensor (keep both)."""
    length = torch.tensor([desc.numel()], dtype=torch.int64)
    return [dist.isend(length, peer, tag=tags.desc_len), dist.isend(desc, peer, tag=tags.desc)], length


def receive_description(peer: int, tags: Tags) -> torch.Tensor:
    """Receives ``peer``'s description (raises the backend's error if ``peer`` died)."""
    length = torch.zeros(1, dtype=torch.int64)
    dist.recv(length, peer, tag=tags.desc_len)
    desc = torch.zeros(int(length.item()), dtype=torch.int64)
    dist.recv(desc, peer, tag=tags.desc)
    return desc


def wait_quietly(work) -> str:
    """Waits for ``work``; returns "" or the error's text (a send to a peer that died fails)."""
    if work is None:
        return ""
    try:
        work.wait()
        return ""
    except Exception as e:  # noqa: BLE001 - the caller reports it with the peer's role
        return str(e)
