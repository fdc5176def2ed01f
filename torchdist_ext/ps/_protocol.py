"""The messages between workers and servers (c10d point-to-point on the default group).

At start each worker and each server exchange a description (length, then the int64 words of
``_layout.describe``) and both refuse a mismatch; each server then sends every worker a REPLY with
the initial parameters. After that a worker sends a server requests, each a float64 CONTROL
message ``[kind, worker rank, clock, lr, words, table, full]`` that the server receives from any
source, followed by what the kind names, which the server receives from that worker (it keeps the
receive of each worker's next dense gradient posted, so that message never waits in a staging
buffer of the transport):

- PUSH: the gradient of the server's dense pieces (float32); if the server holds sparse pieces,
  their touched rows as int64 ``[count per sparse piece..., local row ids...]`` (``words`` long) and
  float32 ``[rows, dim]`` gradients. The server answers with one REPLY once the consistency rule
  lets it (``lr`` is the learning rate the worker's schedule had at the push): a header of int64
  ``[updates taken, live workers, slowest clock, pushes applied, status]`` and the float64 lr (each
  word pair of the float32 buffer viewed as one 64-bit value, so the counters are exact), then the
  dense parameters, or the header alone when ``full`` is 0 (a replica's acknowledgement). Status
  FAILED says the server stopped on an exception.
- PULL: the server answers with a full REPLY now (a worker switching a shard to its replica).
- ROWS: ``words`` int64 local row ids of sparse parameter ``table``; the server answers with those
  rows (float32).
- STATE: the server answers with its state (``torch.save`` bytes: length, then bytes).

A worker that is done sends BYE; a server keeps a receive for BYE posted from each worker, so a
worker that dies fails that receive with the rank's name.
"""
import itertools
from collections import namedtuple

import torch
import torch.distributed as dist

__all__ = []

Tags = namedtuple("Tags", "desc_len desc control reply bye grads ids rows state seed")
_sessions = itertools.count()


def next_tags() -> Tags:
    """The tags of the next server/worker session of this process. Every rank creates its
    ParameterServer or Worker objects in the same order, so the sessions agree; a session's
    leftover receive (a server's last any-source receive) never matches a later session's messages."""
    base = 0x5D00 + 16 * next(_sessions)
    return Tags(*range(base, base + len(Tags._fields)))


def replica_tags(tags: Tags) -> Tags:
    """The tags of the same session's replica copies (a server process serves its own shard on
    ``tags`` and the replica of another on these; a worker talks to each copy on its own tags)."""
    return Tags(*(t + 0x4000 for t in tags))


HEADER = 12  # float32 words before the parameters in a REPLY: 5 int64 counters, the lr as one float64
CONTROL = 7  # float64 words of a CONTROL message
PUSH, ROWS, STATE, PULL = 1, 2, 3, 4  # CONTROL kinds
OK, FAILED = 0, 1  # REPLY status
UPDATES, LIVE, SLOWEST, APPLIED, STATUS = range(5)  # REPLY counters (int64 words of the header)


def control(kind, rank, clock=0, lr=0.0, words=0, table=0, full=1) -> torch.Tensor:
    """A CONTROL message: [kind, worker rank, clock, lr, words that follow, table, full reply wanted]."""
    return torch.tensor([kind, rank, clock, lr, words, table, full], dtype=torch.float64)


def counters(buf: torch.Tensor) -> torch.Tensor:
    """The int64 view of a REPLY buffer's counters (index with UPDATES, LIVE, SLOWEST, APPLIED, STATUS)."""
    return buf[0:10].view(torch.int64)


def lr_word(buf: torch.Tensor) -> torch.Tensor:
    """The float64 view of words 10-11 of a REPLY buffer (the learning rate, exact)."""
    return buf[10:12].view(torch.float64)


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
