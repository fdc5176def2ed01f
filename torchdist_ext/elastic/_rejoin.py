"""A node comes back: a restarted rank (or host) announces itself in the job's store, and the members
admit it at a step boundary by re-forming the group at the larger size, one generation further.

Keys, in the *base* store of the group (the store under torch's ``PrefixStore`` layers: the
``FileStore`` of a ``file://`` rendezvous, the ``EtcdStore`` of ``TDX_STORE``; they outlive any one
rank), all under ``tdx/rejoin/``:

- ``count``: tickets handed out (``add``); a joiner takes the next one;
- ``ticket/<t>``: who took ticket t (host and pid), for the members' record;
- ``admit/<t>``: written by the members' rank 0 when ticket t is admitted: the generation, the
  joiner's rank and world size, and where it takes up the data (epoch, steps of that epoch done,
  sampler slot);
- ``gen``: the current generation (0 until the first admission).

Generation g's group meets under the prefix ``tdx/gen<g>/`` of the base store, so no key of an
older generation is read, and its shared-memory segments are new ones (tdx names them per group);
with the store in etcd, the liveness keys move to generation g's rank numbers too (``_liveness``).
The old group is destroyed first (its segments unlinked).

The members learn of a joiner through a daemon thread that reads ``count`` every
``_POLL_S`` seconds; at a check (every ``rejoin_every`` steps, and when the sampler starts an epoch)
rank 0 broadcasts what its thread saw (one int64), so every member decides the same. Before a step
the broadcast is asynchronous: the one started at a check is waited at the next, so the step does
not wait for it and a joiner is admitted one check after rank 0's thread saw it.
"""
import json
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from . import _liveness

__all__ = ["base_store", "rejoin", "joined"]

_KEY = "tdx/rejoin/"
_POLL_S = 0.1
_ALIVE_LOOK_S = 1.0  # a waiting joiner looks this often whether any member is still alive (etcd)
_joined = None  # the admission record of this process, when it joined a running job


def base_store(group=None):
    """The store under ``group``'s ``PrefixStore`` layers (the one the job's ranks all opened)."""
    group = group if group is not None else dist.group.WORLD
    store = dist.distributed_c10d._world.pg_map[group][1]
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def store_timeout(store):
    """The group's timeout: ``init_process_group`` sets it on the rendezvous store."""
    try:
        return store.timeout
    except (AttributeError, RuntimeError):
        return dist.default_pg_timeout


def joined():
    """This process's admission record (a dict) when it joined a running job with ``rejoin``, else None."""
    return _joined


def _get_json(store, key):
    return json.loads(store.get(key).decode())


def members_alive(store):
    """Whether a member of the job keeps its liveness key in ``store`` (``tdx/alive/``, kept by every
    elastic rank while its process lives: ``_liveness.py``); None for a store that keeps none (not
    an ``EtcdStore``)."""
    from ..etcd_store import EtcdStore

    if not isinstance(store, EtcdStore):
        return None
    return store.count_under(_liveness.ALIVE_PREFIX) > 0


def job_running(store):
    """Whether a job's members already run on ``store``: their rank 0 marked generation 0 or later
    and, in etcd, one of them is still alive (a job that ended leaves its mark behind)."""
    return bool(store.check([_KEY + "gen"])) and members_alive(store) is not False


def earlier_runs(store):
    """(tickets handed out, last generation) that earlier jobs left in ``store``; (0, 0) on a new one."""
    generation = int(store.get(_KEY + "gen").decode()) if store.check([_KEY + "gen"]) else 0
    return int(store.add(_KEY + "count", 0)), generation


def mark_running(store, generation):
    store.set(_KEY + "gen", str(generation))


def rejoin(store, backend="tdx", timeout=timedelta(minutes=10), wait=timedelta(minutes=30)):
    """Joins a running elastic job as a new rank: announces itself in ``store`` (the job's base
    store, e.g. ``FileStore(path)`` of the job's ``file://`` rendezvous or an ``EtcdStore``), waits
    until the members admit it at a step boundary (at most ``wait``), then initializes the default
    process group of the new generation with the rank and world size they gave it.

    Afterwards build the elastic trainer as every member did (same model, optimizer, sampler): it
    receives the parameters, the optimizer state and the step and data position from a live member
    over the new group (nothing from disk). Returns the admission record (``epoch``, ``step``: the
    steps of that epoch already done, ``rank``, ``world_size``, ``generation``, ``times``: when it
    announced itself, was admitted and had its group, by ``time.time()``).
    """
    global _joined
    if dist.is_initialized():
        raise RuntimeError("torchdist_ext.elastic.rejoin: this process already has a default process group; "
                           "rejoin replaces init_process_group in a restarted rank")
    from .._backend import node_id

    _warm_up()
    times = {"announce": time.time()}
    ticket = int(store.add(_KEY + "count", 1))
    store.set(f"{_KEY}ticket/{ticket}", json.dumps({"host": node_id(), "pid": os.getpid()}))
    key = f"{_KEY}admit/{ticket}"
    deadline = time.monotonic() + wait.total_seconds()
    next_look, none_seen = time.monotonic() + _ALIVE_LOOK_S, 0
    while not store.check([key]):
        if time.monotonic() >= next_look:  # a job that ended (or died whole) admits nobody: say so
            none_seen = none_seen + 1 if members_alive(store) is False else 0
            next_look = time.monotonic() + _ALIVE_LOOK_S
            if none_seen >= 2 and not store.check([key]):
                raise RuntimeError(f"torchdist_ext.elastic.rejoin: no member of the job is alive (no liveness key "
                                   "under tdx/alive/ in the etcd store): it ended, or every rank of it failed, "
                                   f"before admitting this process (ticket {ticket}). Start the job again: with "
                                   "no live member the same command starts a new one")
        if time.monotonic() > deadline:
            raise RuntimeError(f"torchdist_ext.elastic.rejoin: not admitted within {wait.total_seconds():.0f} s "
                               f"(ticket {ticket}); the members admit a joiner at a step boundary of an epoch that "
                               "lost a rank, or when their sampler starts an epoch: is the job still training, "
                               "with rejoin=True on its trainer?")
        time.sleep(_POLL_S)
    times["admitted"] = time.time()
    record = _get_json(store, key)
    record["ticket"] = ticket
    reform(store, record["generation"], record["rank"], record["world_size"], backend, timeout)
    times["group"] = time.time()
    record["times"] = times
    _joined = record
    return record


def _warm_up():
    """Imports, before the joiner announces itself, what the user's code after ``rejoin`` would import
    while the members wait for it: the first optimizer a process makes imports ``torch._dynamo``
    (seconds on a loaded host)."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception:  # noqa: BLE001 - a torch without it; nothing to warm
        pass


def reform(store, generation, rank, world_size, backend, timeout):
    """Destroys this process's default group (if any) and makes generation ``generation``'s one."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(backend, store=dist.PrefixStore(f"tdx/gen{generation}/", store), rank=rank,
                            world_size=world_size, timeout=timeout)
    _liveness.regenerate(generation)  # with etcd: this rank's liveness key under its new number


class Watcher:
    """Reads the ticket count of ``store`` every ``_POLL_S`` s in a daemon thread (off the step).

    The thread is stopped and joined at exit (``_liveness.stop_at_exit``), before the interpreter
    finalizes: a daemon thread still inside a store call then (the GIL released in C++) would be
    ended by Python while it takes the GIL back, through a C++ destructor, and the process would
    abort with "terminate called without an active exception"."""

    def __init__(self, store):
        self.store = store
        self.count = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tdx-rejoin-watch", daemon=True)
        _liveness.stop_at_exit(self._stop, self._thread)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            try:
                self.count = int(self.store.add(_KEY + "count", 0))
            except Exception:  # noqa: BLE001 - a store that went (its host died); a recovery handles it
                pass
            self._stop.wait(_POLL_S)


def tickets_seen(watcher, group):
    """Rank 0's view of the ticket count, the same on every rank of ``group`` (one broadcast)."""
    t = torch.tensor([watcher.count if dist.get_rank(group) == 0 else 0], dtype=torch.int64)
    dist.broadcast(t, src=dist.get_global_rank(group, 0), group=group)
    return int(t[0])


def tickets_seen_before(state, watcher, group):
    """The ticket count rank 0 saw at the previous check (0 when there was none on ``group``), the
    same on every rank; starts this check's broadcast, waited at the next one, so the step does not
    wait for it. ``state["pending"]`` holds the broadcast in flight (dropped when the group changes)."""
    pending = state.pop("pending", None)
    t = torch.tensor([watcher.count if dist.get_rank(group) == 0 else 0], dtype=torch.int64)
    state["pending"] = (dist.broadcast(t, src=dist.get_global_rank(group, 0), group=group, async_op=True), t)
    if pending is None:
        return 0
    pending[0].wait()
    return int(pending[1][0])


def admit(store, tickets, generation, world_size, slots):
    """Rank 0's half: one admission record per ticket (``slots``: per joiner, its epoch, step, slot
    and slot count) and the new generation."""
    for i, (ticket, where) in enumerate(zip(tickets, slots)):
        store.set(f"{_KEY}admit/{ticket}", json.dumps(dict(where, generation=generation, rank=world_size - len(tickets) + i,
                                                           world_size=world_size)))
    mark_running(store, generation)


def who(store, ticket):
    try:
        return _get_json(store, f"{_KEY}ticket/{ticket}")
    except Exception:  # noqa: BLE001 - a record that is not there yet: the ticket is enough
        return {}
