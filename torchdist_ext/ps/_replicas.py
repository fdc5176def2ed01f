"""Where each server shard's replica lives: the next server on the replica ring.

The servers are laid on ``torchdist_ext.elastic._placement``'s ring (the one ElasticFSDP and
ElasticPipeline keep their replicas on): on one host the servers in rank order, across hosts
alternating hosts, so that no shard's replica sits on its own server's host while the hosts'
server counts allow it. The holder of shard j's replica is server j's ring predecessor; each server
therefore holds its own shard and the replica of exactly one other.
"""
from typing import List

from ..elastic._placement import Ring, group_node_ids, replica_ring

__all__ = []


def holders(server_nodes: List[str]) -> List[int]:
    """Per shard j (server rank j), the server rank that holds its replica, from the servers' node ids."""
    ring = Ring(replica_ring(server_nodes))
    return [ring.holder(j) for j in range(len(server_nodes))]


def job_holders(num_servers: int) -> List[int]:
    """``holders`` of this job's servers; collective over the default group (every rank calls it)."""
    return holders(group_node_ids(None)[:num_servers])
