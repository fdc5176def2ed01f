"""Where each rank's in-memory replica lives: the replica ring.

ElasticFSDP and ElasticPipeline keep, on each rank, a copy of one other rank's state (its
"source"); the rank that holds a rank's copy is its "holder". They are neighbours on a ring of the
group's ranks: the holder of ``ring[i]`` is ``ring[i - 1]`` and its source ``ring[i + 1]``. On one
host the ring is the ranks in order (rank r holds rank r + 1's state). Across hosts the ring
alternates hosts so that no rank's copy sits on its own host: the loss of a host then never takes
a rank's state together with its only copy. That is possible while no host holds more than half
of the group's ranks; beyond that the ring still alternates where it can.
"""
import torch.distributed as dist

from .._backend import node_id

__all__ = ["node_id", "group_node_ids", "replica_ring", "Ring"]


def group_node_ids(group):
    """Every rank's ``node_id()`` (index: group rank); collective over ``group``."""
    ids = [None] * dist.get_world_size(group)
    dist.all_gather_object(ids, node_id(), group=group)
    return ids


def replica_ring(node_ids):
    """The ring order (a permutation of ``range(len(node_ids))``) in which ring neighbours sit on
    different hosts wherever the hosts' sizes allow; the identity on one host.

    The ranks are listed host by host (the largest host first, ranks ascending within a host) and
    laid into the even ring positions, then the odd ones: a host's ranks are never adjacent unless
    it holds more than half of them (then some must be).
    """
    n = len(node_ids)
    hosts = list(dict.fromkeys(node_ids))
    if len(hosts) < 2:
        return list(range(n))
    members = {h: [r for r in range(n) if node_ids[r] == h] for h in hosts}
    order = sorted(hosts, key=lambda h: (-len(members[h]), hosts.index(h)))
    sequence = [r for h in order for r in members[h]]
    ring = [None] * n
    positions = list(range(0, n, 2)) + list(range(1, n, 2))
    for position, r in zip(positions, sequence):
        ring[position] = r
    return ring


class Ring:
    """A replica ring over group ranks: ``holder(r)`` keeps ``r``'s copy, ``source(r)`` is whose
    copy ``r`` keeps."""

    def __init__(self, order):
        self.order = list(order)
        if sorted(self.order) != list(range(len(self.order))):
            raise ValueError(f"Ring: {self.order} is not a permutation of the group ranks 0..{len(self.order) - 1}")
        self._at = {r: i for i, r in enumerate(self.order)}

    def __len__(self):
        return len(self.order)

    def __eq__(self, other):
        return isinstance(other, Ring) and other.order == self.order

    def __repr__(self):
        return f"Ring({self.order})"

    def holder(self, rank):
        return self.order[(self._at[rank] - 1) % len(self.order)]

    def source(self, rank):
        return self.order[(self._at[rank] + 1) % len(self.order)]
