"""A c10d ``Store`` kept in an etcd cluster, so that no single host holds the job's store.

torch's default store (the ``TCPStore`` of ``init_process_group``, or torchrun's) lives in one
process on one host; when that host goes, every survivor loses the store, and with it what needs
it after a failure (re-forming the cross-host part of a shrunk group, the notes of which ranks are
gone). etcd keeps its keys on a replicated (Raft) cluster: with 3 members on 3 hosts it goes on
while any 2 are up, whichever held the leader. ``EtcdStore`` talks etcd's v3 API through the
``pyetcd`` client (PyPI ``etcd-sdk-python``), with every member as an endpoint: when the member it
uses stops answering, the call is retried on another until the store's timeout.

    store = EtcdStore("etcd://hostA:2379,hostB:2379,hostC:2379/myjob")
    dist.init_process_group("tdx", store=store, rank=rank, world_size=world_size)

Keep a reference to the store for as long as a group uses it (torch holds only its C++ half;
``init_distributed`` keeps the ones it makes). Every job needs its own prefix (the path of the
URL): keys are never deleted by the store.
``init_distributed`` builds one from ``TDX_STORE`` (see ``torchdist_ext.launch``). A run on one
host needs none of this: the default store is fine there.
"""
import datetime
import time
from urllib.parse import urlsplit

import torch.distributed as dist

__all__ = ["EtcdStore", "parse_etcd_url"]

_POLL_FIRST, _POLL_MAX = 0.002, 0.05  # seconds between reads while waiting for a key


def parse_etcd_url(url):
    """``"etcd://h1:2379,h2:2379/prefix"`` -> ``([("h1", 2379), ("h2", 2379)], "prefix/")``.

    The port defaults to 2379; the prefix (the path) must not be empty: every job needs its own.
    """
    if not isinstance(url, str) or not url.startswith("etcd://"):
        raise ValueError(f"EtcdStore: {url!r} is not an etcd URL; write etcd://host1:2379,host2:2379,host3:2379/"
                         "<job prefix> (every member of the cluster, then a prefix of this job's own)")
    rest = url[len("etcd://"):]
    hosts, _, prefix = rest.partition("/")
    endpoints = []
    for part in hosts.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"EtcdStore: {url!r} has an empty member between commas")
        split = urlsplit("//" + part)
        try:
            port = split.port or 2379
        except ValueError:
            raise ValueError(f"EtcdStore: {url!r}: {part!r} has a port that is not a number in 1-65535") from None
        if not split.hostname:
            raise ValueError(f"EtcdStore: {url!r}: {part!r} names no host")
        endpoints.append((split.hostname, port))
    prefix = prefix.strip("/")
    if not prefix:
        raise ValueError(f"EtcdStore: {url!r} has no job prefix; add one after the members, e.g. "
                         f"etcd://{hosts}/myjob-42 (keys of different jobs must not meet)")
    return endpoints, prefix + "/"


def _with_failover(what, endpoints, timeout, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on the client, retried (on another member: the client moves on from
    one that failed) while no member answers or the cluster is between leaders, for ``timeout``
    seconds; then ``DistStoreError`` naming the members and the last error."""
    from pyetcd import exceptions as ex

    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn(*args, **kwargs)
        except (ex.ConnectionFailedError, ex.ConnectionTimeoutError, ex.NoServerAvailableError) as e:
            error = e
        except ex.Etcd3Exception as e:  # a member between leaders ("no leader", "leader changed")
            if "leader" not in str(e):
                raise
            error = e
        if time.monotonic() > deadline:
            members = ", ".join(f"{h}:{p}" for h, p in endpoints)
            raise dist.DistStoreError(f"etcd: {what} failed: no member of {members} answered within {timeout:g} s; "
                                      f"last error: {type(error).__name__}: {error}") from error
        time.sleep(0.05)


def _client(endpoints, call_timeout):
    try:
        import pyetcd
    except ImportError as e:
        raise ImportError("EtcdStore needs the etcd v3 client pyetcd: pip install etcd-sdk-python protobuf "
                          "(or pip install 'torchdist_ext[etcd]')") from e
    # A member that failed is tried again after 1 s (the client's default is 300 s).
    eps = [pyetcd.Endpoint(host, port, secure=False, time_retry=1.0) for host, port in endpoints]
    return pyetcd.MultiEndpointEtcd3Client(endpoints=eps, timeout=call_timeout, failover=True)


class EtcdStore(dist.Store):
    """A c10d ``Store`` over an etcd v3 cluster (``set``, ``get``, ``add``, ``compare_set``,
    ``check``, ``wait``, ``delete_key``, ``num_keys``), usable wherever torch takes a store
    (``init_process_group(store=...)``, ``PrefixStore``, Gloo, tdx).

    Args:
        url: ``etcd://host1:port,host2:port,.../prefix``: every member of the cluster (a call goes
            to one of them and moves to another when it stops answering) and this job's key prefix.
        timeout: how long ``get`` and ``wait`` wait for a key, and how long a call keeps retrying
            while no member answers (default: torch's 300 s; ``set_timeout`` changes it).
        call_timeout: seconds one request to one member may take before the next member is tried.
    """

    def __init__(self, url, timeout=None, call_timeout=2.0):
        super().__init__()  # the pybind trampoline
        self.url = url
        self._endpoints, self._prefix = parse_etcd_url(url)
        self._client = _client(self._endpoints, call_timeout)
        if timeout is not None:
            self.set_timeout(timeout if isinstance(timeout, datetime.timedelta)
                             else datetime.timedelta(seconds=float(timeout)))

    def __reduce__(self):
        raise TypeError("EtcdStore: a store is not sent to other processes; build one from the same URL there")

    # ------------------------------------------------------------------ plumbing

    def _key(self, key):
        return self._prefix + key

    def _deadline(self, override=None):
        timeout = override if override is not None else self.timeout
        return time.monotonic() + timeout.total_seconds()

    def _call(self, what, fn, *args, deadline=None, **kwargs):
        """``fn(*args)``, retried on another member while none answers, until ``deadline``
        (default: the store's timeout from now)."""
        left = (deadline - time.monotonic()) if deadline is not None else self.timeout.total_seconds()
        return _with_failover(f"EtcdStore {what}", self._endpoints, max(left, 0.0), fn, *args, **kwargs)

    def _read(self, key, deadline=None):
        value, _ = self._call(f"get {key!r}", self._client.get, self._key(key), deadline=deadline)
        return value

    @staticmethod
    def _bytes(value):
        if isinstance(value, str):
            return value.encode()
        return bytes(value)

    # ------------------------------------------------------------------ the Store interface

    # ------------------------------------------------------------------ the fence

    def fence_on(self, key):
        """From now on this process's writes through this store (``set``, ``add``, ``compare_set``,
        ``delete_key``) succeed only while ``key`` exists: they are etcd transactions that compare
        its version. ``key`` is the rank's liveness key (``torchdist_ext.elastic``), attached to its
        lease, so once the others revoke that lease (they excluded the rank) or it expires, every
        write of the rank fails instead of landing among the keys of a group it is no longer in."""
        self._fence = self._key(key)

    def _fenced(self):
        """The guards a write carries: [] before ``fence_on``."""
        fence = getattr(self, "_fence", None)
        return [] if fence is None else [self._client.transactions.version(fence) > 0]

    def _refuse_if_fenced(self, key):
        fence = getattr(self, "_fence", None)
        if fence is not None and self._read(fence[len(self._prefix):]) is None:
            raise dist.DistStoreError(f"EtcdStore: write of {key!r} refused: this rank's liveness key {fence!r} is "
                                      "gone (its lease was revoked by the other ranks, which excluded it from the "
                                      "group, or it expired): it can take no further part in the job and must exit")

    def set(self, key, value):
        if getattr(self, "_fence", None) is None:
            self._call(f"set {key!r}", self._client.put, self._key(key), self._bytes(value))
            return
        ok, _ = self._call(f"set {key!r}", self._client.transaction, compare=self._fenced(),
                           success=[self._client.transactions.put(self._key(key), self._bytes(value))], failure=[])
        if not ok:
            self._refuse_if_fenced(key)

    def get(self, key):
        self.wait([key])
        value = self._read(key)
        if value is None:
            raise dist.DistStoreError(f"EtcdStore: key {key!r} was deleted while being read")
        return value

    def check(self, keys):
        return all(self._read(k) is not None for k in keys)

    def wait(self, keys, timeout=None):
        deadline = self._deadline(timeout)
        pause = _POLL_FIRST
        missing = list(keys)
        while True:
            missing = [k for k in missing if self._read(k, deadline) is None]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"EtcdStore: wait timed out after {timeout or self.timeout} for keys "
                                          f"{missing} under {self._prefix!r}")
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX)

    def add(self, key, amount):
        """Adds ``amount`` to the integer at ``key`` (0 when missing) atomically; returns the sum."""
        full = self._key(key)
        tx = self._client.transactions
        while True:
            value, meta = self._call(f"add {key!r}", self._client.get, full)
            current = 0 if value is None else int(value)
            new = str(current + int(amount)).encode()
            guard = tx.version(full) == 0 if value is None else tx.mod(full) == meta.mod_revision
            ok, _ = self._call(f"add {key!r}", self._client.transaction, compare=[guard] + self._fenced(),
                               success=[tx.put(full, new)], failure=[])
            if ok:
                return current + int(amount)
            self._refuse_if_fenced(key)

    def compare_set(self, key, expected, desired):
        """Sets ``key`` to ``desired`` if it holds ``expected`` (or is missing and ``expected`` is
        empty); returns the value it holds afterwards."""
        full, expected, desired = self._key(key), self._bytes(expected), self._bytes(desired)
        tx = self._client.transactions
        guard = tx.version(full) == 0 if not expected else tx.value(full) == expected
        while True:
            ok, _ = self._call(f"compare_set {key!r}", self._client.transaction, compare=[guard] + self._fenced(),
                               success=[tx.put(full, desired)], failure=[])
            if ok:
                return desired
            self._refuse_if_fenced(key)
            value = self._read(key)
            if value is not None or expected:
                return value if value is not None else expected

    def delete_key(self, key):
        self._refuse_if_fenced(key)
        return bool(self._call(f"delete {key!r}", self._client.delete, self._key(key)))

    def clone(self):
        """This store itself: torch clones a group's store for the group a shrink makes, and one
        client serves every thread (its gRPC channels are thread-safe). A new Python object would
        die with this call, and torch keeps only the C++ half of a store written in Python."""
        return self

    def num_keys(self):
        return self.count_under("")

    def count_under(self, prefix):
        """How many keys of this store start with ``prefix`` (one count request, no values read)."""
        response = self._call("num_keys", self._client.get_prefix_response, self._key(prefix), count_only=True)
        return int(response.count)
