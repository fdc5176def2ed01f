"""Registration of the "tdx" backend with torch.distributed, and the making of its groups.

A group is made here in one pass, Python to C++ once: the ranks tell each other their hosts
through the group's store, a group spanning hosts gets its Gloo groups (torch's ProcessGroupGloo,
which reads GLOO_SOCKET_IFNAME and the device transport as torch does), and _C.create_backend builds
the rest. A shrink whose survivors span hosts makes their Gloo groups the same way before the C++
shrink (_shrink). Gloo groups are made in Python because torch's C++ headers for them need Gloo's
own headers, which torch's wheels do not ship.
"""
import os
import socket

import torch
import torch.distributed as dist

from . import _C

BACKEND_NAME = "tdx"


def _gloo_groups(store, rank, size, timeout, node_ids):
    """Gloo groups for the cross-host part, or (None, None) when every rank shares one host.

    Returns (all ranks, this rank's slice group). The slice group holds the ranks with this rank's
    local index on every host, ordered by host; it exists only when every host has as many ranks.
    Every rank of the group creates the same groups in the same order (Gloo rendezvous).
    """
    hosts = list(dict.fromkeys(node_ids))  # in order of each host's lowest rank
    if len(hosts) == 1:
        return None, None
    members = {h: [r for r in range(size) if node_ids[r] == h] for h in hosts}
    gloo_all = dist.ProcessGroupGloo(dist.PrefixStore("tdx/gloo/all/", store), rank, size, timeout)
    if len({len(m) for m in members.values()}) != 1:
        return gloo_all, None
    me = node_ids[rank]
    local_index = members[me].index(rank)
    gloo_slice = dist.ProcessGroupGloo(
        dist.PrefixStore(f"tdx/gloo/slice{local_index}/", store), hosts.index(me), len(hosts), timeout
    )
    return gloo_all, gloo_slice


def node_id():
    """This rank's host as tdx groups it: TDX_NODE_ID (simulated hosts), else the host name."""
    return os.environ.get("TDX_NODE_ID") or socket.gethostname()


def _exchange_node_ids(store, rank, size):
    """Every rank's node id through the group's store, by group rank (collective over the group)."""
    store.set(f"tdx/node/{rank}", node_id())
    return [store.get(f"tdx/node/{r}").decode() for r in range(size)]


def spans_hosts(group):
    """Whether the tdx process group ``group`` has ranks on more than one host (as tdx groups them:
    ``node_id``; a group made by ``shrink_group`` included); its point-to-point messages then go
    through Gloo. False for groups tdx did not make."""
    backend = _tdx_backend_of(group)
    return backend is not None and backend.spans_hosts


def _tdx_backend_of(group):
    """The TdxBackend of ``group`` in this process, or None (a group on another backend, or none)."""
    try:
        backend = group._get_backend(torch.device("cpu"))
    except Exception:  # noqa: BLE001 - no CPU backend, or torch's tables already gone at exit
        return None
    return backend if isinstance(backend, _C.TdxBackend) else None


def _create_tdx_backend(dist_opts, backend_opts=None):
    """Creator called by torch.distributed for every process group that uses "tdx"."""
    store, rank, size = dist_opts.store, dist_opts.group_rank, dist_opts.group_size
    node_ids = _exchange_node_ids(store, rank, size)
    gloo_all, gloo_slice = _gloo_groups(store, rank, size, dist_opts.timeout, node_ids)
    try:
        return _C.create_backend(
            store,
            rank,
            size,
            dist_opts.timeout,
            str(dist_opts.group_id),
            [int(r) for r in dist_opts.global_ranks_in_group],
            node_ids,
            gloo_all,
            gloo_slice,
        )
    except RuntimeError as e:
        _explain_stale_rendezvous(e)
        raise


def _explain_stale_rendezvous(error):
    """A restarted torchrun worker that read the previous attempt's keys gets a hint.

    torchrun's agent keeps one TCPStore across restarts unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    (pytorch/pytorch#135712), so a restarted rank may read a dead rank's segment name.
    """
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0")
    if (restarted and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and "cannot open peer shared-memory segment" in str(error)):
        raise RuntimeError(
            f"{error}\nThis worker was restarted by torchrun (TORCHELASTIC_RESTART_COUNT="
            f"{os.environ['TORCHELASTIC_RESTART_COUNT']}) and torchrun shares one store across restarts, so "
            f"it read the previous attempt's rendezvous keys. Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for "
            f"torchrun, or launch with `python -m torchdist_ext.run`, which sets it."
        ) from error


def _shrink(self, ranks_to_exclude, shrink_flags=0, opts_override=None):
    """TdxBackend.shrink (torch.distributed.shrink_group calls it): the survivors' backend.

    Collective over the surviving ranks. Where they span hosts, their Gloo groups are made here,
    under a store prefix naming this shrink, then the C++ shrink re-forms each host's shared memory.
    """
    meeting = self._shrink_meeting(list(ranks_to_exclude), shrink_flags, opts_override)
    store, rank, size, timeout, node_ids, excluded = meeting
    gloo_all, gloo_slice = _gloo_groups(store, rank, size, timeout, node_ids)
    return self._shrink_with(store, rank, size, timeout, node_ids, excluded, shrink_flags, gloo_all, gloo_slice)


def shut_down_live_groups():
    """At interpreter exit with tdx groups still alive (no ``destroy_process_group``: a rank that
    raised, a parameter server whose loop failed): shuts each down while Python still runs. Their
    threads then fail the operations still posted (a server's receives) and end, running those
    operations' Python future callbacks now; a thread that did so once the interpreter finalizes
    would be ended by Python inside a destructor, and the process would abort with "terminate
    called without an active exception". Registered at import, so it runs after the failure notice
    (atexit runs last-registered first): the peers learn the exit first."""
    for _, backend in _live_tdx_groups():
        backend._shutdown_at_exit()


def _live_tdx_groups():
    """[(group, TdxBackend)] of this process's live tdx groups (none once torch's tables are gone)."""
    try:
        groups = list(dist.distributed_c10d._world.pg_map)
    except Exception:  # noqa: BLE001 - torch's tables changing under another thread, or gone at exit
        return []
    found = [(pg, _tdx_backend_of(pg)) for pg in groups]
    return [(pg, b) for pg, b in found if b is not None]


def is_registered() -> bool:
    """Whether "tdx" is registered with torch.distributed in this process."""
    return BACKEND_NAME in dist.Backend.backend_list


def register() -> None:
    """Registers "tdx" with torch.distributed; a second call (or import) does nothing."""
    if is_registered():
        return
    _C.TdxBackend.shrink = _shrink
    dist.Backend.register_backend(
        BACKEND_NAME, _create_tdx_backend, extended_api=True, devices=["cpu", "cuda"]
    )
