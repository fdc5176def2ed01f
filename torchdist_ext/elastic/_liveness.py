"""Which ranks are alive, kept in etcd: a whole host that is lost leaves no host mate to say so.

A rank's host mates see its process go (shared memory) and leave a note in the store for the other
hosts; when every rank of a host goes at once (the host died), nobody leaves that note. So, when
the group's store is an ``EtcdStore`` (``TDX_STORE``), every rank of an elastic trainer keeps a key
``tdx/alive/g<generation>/<global rank>`` attached to an etcd lease of ``TDX_FAILURE_DETECTION_S`` seconds
(default 5), refreshed by a daemon thread three times per period while the rank makes progress (it
stops when the rank's last collective, wait or finished step is that old: a rank hung in user code
goes silent as a stopped or dead one does), sooner again after a failed refresh, while the client
moves to another member. etcd deletes the key when the lease expires, that is at most that long
after the rank's host went silent (powered off, or its link to the majority of etcd members cut),
or at once when a peer saw the rank's process end (or excluded it) and revoked the lease
(``_watch.py``, which also interrupts the groups waiting on it). ``silent_ranks`` lists the
group's ranks whose key is gone. The generation is the one of the default group (0, then +1 each
time the members admit joiners and re-form it, numbering the ranks again): at each re-form every
member puts its key under the new generation's number, on the same lease (``regenerate``), and
the watch of the older generation retires, so no key of one generation names another's rank.

Nothing of this runs without an ``EtcdStore``: a one-host run needs no service.
"""
import atexit
import os
import threading
import time

import torch.distributed as dist

from .. import _C
from .._backend import node_id
from . import _watch
from ._errors import RankExcludedError

__all__ = ["detection_seconds", "note_wait_seconds", "regenerate", "revoke", "start", "silent_ranks", "known_gone",
           "probe_hosts", "settle"]

ALIVE_PREFIX = _watch.ALIVE  # every generation's liveness keys are under it
_started = {}  # id(store) -> (store, lease, thread, watch)
_generation = 0  # the default group's generation (``regenerate``)
watching = None  # set by the elastic trainers while the stuck-rank watch is armed: renew only with progress


def _key(rank):
    return _watch.alive_key(_generation, rank)


def detection_seconds():
    """``TDX_FAILURE_DETECTION_S`` (seconds, default 5): how long after a host went silent its
    ranks count as gone."""
    text = os.environ.get("TDX_FAILURE_DETECTION_S", "5")
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"TDX_FAILURE_DETECTION_S={text!r} is not a number of seconds (e.g. 5)") from None
    if value <= 0:
        raise ValueError(f"TDX_FAILURE_DETECTION_S={text!r} must be > 0 seconds")
    return value


def note_wait_seconds():
    """How long ``gone_ranks`` waits for another host's note on a gone rank when it knows of none:
    TDX_FAILURE_DETECTION_S / 2.5 (2 s with the default 5)."""
    return detection_seconds() / 2.5


def _group_global_ranks(group):
    group = group if group is not None else dist.group.WORLD
    return {dist.get_global_rank(group, r): r for r in range(dist.get_world_size(group))}


def _watch_of(group):
    store = _etcd_store(group)
    started = _started.get(id(store)) if store is not None else None
    return started[3] if started else None


def known_gone(group):
    """``{group rank: why}`` of the ranks of ``group`` that the liveness watch knows ended or went
    silent (no wait); {} without an etcd store."""
    watch = _watch_of(group)
    if watch is None:
        return {}
    ranks = _group_global_ranks(group)
    return {ranks[g]: f"rank {ranks[g]} (global {g}) is gone: {why}" for g, why in watch.known_gone(ranks).items()}


def settle(group):
    """When the watch knows a rank of ``group`` gone: gives the other ranks of its host a moment
    to be told gone too (see ``_watch.Watch.settle``), so that the survivors agree on whom to exclude."""
    watch = _watch_of(group)
    if watch is not None:
        watch.settle(list(_group_global_ranks(group)))


def probe_hosts(group, hosts):
    """Tries the liveness port of every rank of ``group`` on ``hosts`` (node ids, e.g. those a
    failed collective named, ``failed_hosts()``): a refused connection confirms that rank's end at
    once (and revokes its lease, which interrupts the other ranks' waits on it)."""
    watch = _watch_of(group)
    if watch is not None and hosts:
        watch.probe_hosts(set(hosts), list(_group_global_ranks(group)))


def _etcd_store(group):
    """The ``EtcdStore`` under ``group``'s store (through its ``PrefixStore`` layers), or None."""
    from ..etcd_store import EtcdStore

    store = dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    if group is not None and group is not dist.group.WORLD:
        try:
            store = dist.distributed_c10d._world.pg_map[group][1]
        except (KeyError, IndexError, TypeError):
            pass
    while store is not None and not isinstance(store, EtcdStore):
        store = getattr(store, "underlying_store", None)
    return store


def start(group=None):
    """Keeps this rank's liveness key in the group's etcd store (once per store; nothing without
    one). Returns whether liveness is kept."""
    store = _etcd_store(group)
    if store is None:
        return False
    if id(store) in _started:
        return True
    ttl = detection_seconds()
    client = store._client
    lease = store._call("liveness lease", client.lease, max(1, round(ttl)))
    watch = _keep_key(store, lease, ttl)
    # Its own client, whose requests give up on a member after TDX_FAILURE_DETECTION_S / 5 (the
    # store's after 2 s): a refresh stuck on a member whose host was cut off moves on to another
    # in time to keep the lease (a refresh period, a stuck try and a retry stay well under the lease).
    from ..etcd_store import _client as etcd_client

    refresher = etcd_client(store._endpoints, max(0.2, ttl / 5))

    stop = threading.Event()

    def refresh():
        pause = ttl / 3
        while not stop.wait(pause):
            if watching is not None and _C.seconds_since_progress() >= ttl:
                continue  # a rank hung in user code lets its lease expire, as a stopped one does
            try:
                list(refresher.refresh_lease(lease.id))
                pause = ttl / 3
            except Exception:  # noqa: BLE001 - a member that went; the client moves to another: try it soon
                pause = min(0.1, ttl / 3)

    thread = threading.Thread(target=refresh, name="tdx-liveness", daemon=True)
    stop_at_exit(stop, thread)
    thread.start()
    _started[id(store)] = (store, lease, thread, watch)
    return True


def _keep_key(store, lease, ttl):
    """Puts this rank's key of the current generation on ``lease`` and starts its watch."""
    watch = _watch.Watch(store, dist.get_rank(), node_id(), ttl, _generation)
    store._call("liveness key", store._client.put, store._key(_key(dist.get_rank())), watch.value(lease), lease=lease)
    watch.start()
    store.fence_on(_key(dist.get_rank()))  # its writes fail once the lease is gone (revoke below)
    return watch


def regenerate(generation):
    """The default group was re-formed as ``generation`` (``_rejoin.reform``, this process's rank
    and the group's size may have changed): this rank's liveness key moves to that generation's
    number on the same lease, and a new watch of that generation's keys replaces the old one. In a
    process that keeps no key yet (a joiner), only the generation is noted for ``start``."""
    global _generation
    _generation = generation
    for entry, (store, lease, thread, watch) in list(_started.items()):
        watch.retire()
        _started[entry] = (store, lease, thread, _keep_key(store, lease, watch.ttl))


def revoke(group, ranks):
    """Revokes the liveness leases of ``ranks`` (``{group rank: why}``, or group ranks) that the
    others exclude: their keys go at once, and so does every write they would make through the
    store (``EtcdStore.fence_on``). Each revoke first leaves ``tdx/ended/g<generation>/<global
    rank>`` (the others excluded it, and why), so the ranks that see its key go do not take it for
    an expired lease.
    Nothing without an etcd store; a lease already gone is skipped."""
    store = _etcd_store(group)
    if store is None or id(store) not in _started:
        return
    watch = _started[id(store)][3]
    group = group if group is not None else dist.group.WORLD
    reasons = ranks if isinstance(ranks, dict) else dict.fromkeys(ranks, "")
    for r, why in reasons.items():
        global_rank = dist.get_global_rank(group, r)
        _, meta = store._call("liveness key", store._client.get, store._key(_key(global_rank)))
        if meta is not None and meta.lease_id:
            watch.end(global_rank, f"the others excluded it ({why})" if why else "the others excluded it",
                      meta.lease_id)


def _own_key_gone(store, me, ttl):
    """This rank's own liveness key is gone: the others count it as gone (they excluded it, or its
    lease expired while it was cut off from the etcd majority or stalled): raises RankExcludedError."""
    revoked, _ = _started[id(store)][3].end_note(me)  # None also when etcd is unreachable from here
    how = (f"the others revoked its lease: {revoked}" if revoked is not None else
           f"its lease expired: no refresh for {ttl:g} s, TDX_FAILURE_DETECTION_S")
    raise RankExcludedError(f"torchdist_ext.elastic: this rank was excluded from the group: its own liveness key in "
                            f"etcd is gone ({how}), so the others count it as gone and went on without it. It was "
                            "cut off from the etcd majority or stalled that long (a stopped process, a hang, the "
                            "GIL held); this process can take no further part and must exit. Restart it to rejoin, "
                            "or raise TDX_FAILURE_DETECTION_S if stalls that long are expected")


def silent_ranks(group, wait):
    """``{group rank: why}`` for the ranks of ``group`` whose liveness key is gone; when none is,
    looks again until ``wait`` seconds have passed. {} without an etcd store. Raises
    ``RankExcludedError`` when this rank's own key is gone (the others went on without it)."""
    store = _etcd_store(group)
    if store is None or id(store) not in _started:
        return {}
    ttl = detection_seconds()
    group = group if group is not None else dist.group.WORLD
    ranks = {dist.get_global_rank(group, r): r for r in range(dist.get_world_size(group))}
    me = dist.get_rank()
    deadline = time.monotonic() + wait
    while True:
        if not store.check([_key(me)]):
            _own_key_gone(store, me, ttl)
        gone = known_gone(group)
        watch = _started[id(store)][3]
        for global_rank, group_rank in ranks.items():
            if group_rank in gone:
                continue
            if global_rank != me and not store.check([_key(global_rank)]):
                gone[group_rank] = f"rank {group_rank} (global {global_rank}) is gone: {watch.why_gone(global_rank)}"
        if gone or time.monotonic() > deadline:
            return gone
        _C.note_progress()  # waiting for the others' leases is progress: this rank's own lease goes on
        time.sleep(0.1)


# (stop event, thread) of the daemon threads that call into a store or etcd client: stopped and joined
# at exit, before the interpreter finalizes. A daemon thread still inside such a call then (the GIL
# released in C++) is ended by Python as it takes the GIL back, through a C++ destructor, and the
# process aborts with "terminate called without an active exception".
_at_exit = []


def stop_at_exit(stop, thread):
    """Registers ``thread``, whose loop ends once ``stop`` (a threading.Event) is set, for the exit hook."""
    _at_exit.append((stop, thread))


@atexit.register
def _stop_threads_at_exit(timeout=2.0):
    deadline = time.monotonic() + timeout
    for stop, _ in _at_exit:
        stop.set()
    for _, thread in _at_exit:
        if thread.is_alive():
            thread.join(max(0.0, deadline - time.monotonic()))
