"""Telling a lost host within milliseconds, and waking the ranks that wait on it.

Every rank that keeps a liveness key (``_liveness.start``) also listens on a TCP port of its own
(published in the key's value, with its host and lease) and, through one daemon thread per
process, holds a connection to the port of every rank of the *other* hosts. Nothing is ever sent
on these connections; they only end:

- a rank's process ends (SIGKILL, a crash, its whole host's processes killed): its kernel closes
  the connection at once, and the peers read its end. That is a positive signal, unlike silence:
  the peer that reads it interrupts its groups holding that rank at once, then writes
  ``tdx/ended/g<generation>/<global rank>`` (why) and revokes the rank's lease, so etcd deletes its liveness key
  for everyone. A rank that exits cleanly says "left" on its connections (and in etcd) first;
- a host that powered off or whose link was cut sends nothing: its lease expires after
  ``TDX_FAILURE_DETECTION_S`` and etcd deletes the key then.

Whoever revokes a rank's lease (a peer that read its end, the ranks that excluded it) writes
``tdx/ended/g<generation>/<global rank>`` first, so a key that goes without that note went because its lease
expired, and each rank that sees a key go says which (``why_gone``).

A second daemon thread watches ``tdx/alive/`` in etcd (a watch, with a look at every key each
``TDX_FAILURE_DETECTION_S`` / 10 in case the watch's member went silent) and, when a rank's key is
deleted and the rank did not leave cleanly (``tdx/ended/g<generation>/<rank>`` "left", written at exit), calls
``interrupt`` on every tdx group of this process holding that rank: every rank blocked in such a
group's collective or p2p (shared memory and Gloo) wakes with an error naming the operation, its
sequence number and the silent ranks, and the elastic trainer recovers at once instead of at the
group timeout.
"""
import atexit
import json
import os
import selectors
import socket
import sys
import threading
import time

import torch.distributed as dist

from .._backend import _live_tdx_groups

ALIVE = "tdx/alive/"
ENDED = "tdx/ended/"


def alive_key(generation, rank):
    """The liveness key of ``rank`` (global) in the group of ``generation`` (re-formed at each
    admission of joiners, which numbers the ranks again): ``tdx/alive/g<generation>/<rank>``."""
    return f"{ALIVE}g{generation}/{rank}"
_LEFT = "left"


def _group_backends():
    """[(global ranks, tdx backend)] of this process's live tdx groups."""
    out = []
    for pg, backend in _live_tdx_groups():
        try:
            out.append((dist.get_process_group_ranks(pg), backend))
        except Exception:  # noqa: BLE001 - a group being destroyed
            continue
    return out


class Watch:
    """The liveness watch of one ``EtcdStore`` (see the module docstring)."""

    def __init__(self, store, rank, host, ttl, generation=0):
        self.store, self.rank, self.host, self.ttl = store, rank, host, ttl
        self.alive, self.ended = f"{ALIVE}g{generation}/", f"{ENDED}g{generation}/"  # this generation's keys
        self.retired = False  # the group was re-formed: a newer generation's watch took over
        self.client = store._client
        self.mu = threading.Lock()
        self.info = {}    # global rank -> {"host", "addr", "port", "lease"} from its liveness key
        self.gone = {}    # global rank -> why (deleted keys of ranks that did not leave)
        self.interrupted = set()
        self.silent = set()  # gone ranks whose lease expired (not a told end): their host may be cut off
        self.stopped = False  # at exit: no new watch
        self.left = set()  # ranks that said "left" on their liveness connection (a clean exit)
        self.accepted = []  # the other ranks' connections to this one
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind(("0.0.0.0", 0))
        self.listener.listen(128)
        self.selector = selectors.DefaultSelector()
        self.conns = {}   # global rank -> socket
        self.pending = []  # ranks to connect to
        self.wake_r, self.wake_w = socket.socketpair()
        self.selector.register(self.wake_r, selectors.EVENT_READ, None)
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")

    # -------------------------------------------------------------- what a rank publishes

    def address(self):
        """The address this rank's peers reach it at: the local end of a route to an etcd member."""
        host, port = self.store._endpoints[0]
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            probe.connect((socket.gethostbyname(host), port))
            return probe.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())
        finally:
            probe.close()

    def value(self, lease):
        return json.dumps({"host": self.host, "addr": self.address(), "port": self.listener.getsockname()[1],
                           "lease": lease.id, "pid": os.getpid()}).encode()

    def start(self):
        threading.Thread(target=self._watch_loop, name="tdx-liveness-watch", daemon=True).start()
        threading.Thread(target=self._conn_loop, name="tdx-liveness-conns", daemon=True).start()
        atexit.register(self.close)

    def retire(self):
        """The group was re-formed (a newer generation, its ranks numbered again): this watch stops
        telling anything. Its etcd watch ends; its sockets stay open, so that no peer's watch of
        this generation, not yet retired, reads an end; they close with the process."""
        self.retired = self.stopped = True
        self.wake_w.send(b"x")

    def close(self):
        """At exit: unless the process is failing (an uncaught exception, a non-zero ``sys.exit``),
        says it left, so that the others do not take its end for a failure; then ends the etcd
        watch (a gRPC stream still open while the interpreter finalizes can crash it)."""
        from .. import _failure_notice

        self.stopped = True
        if self.retired:
            return  # the watch of the current generation says it
        if not _failure_notice.failing and getattr(sys, "last_value", None) is None:
            for conn in list(self.accepted):
                try:
                    conn.send(_LEFT.encode())
                except OSError:
                    pass
            try:
                self.store._call("liveness leave", self.client.put, self.store._key(f"{self.ended}{self.rank}"),
                                 _LEFT.encode(), deadline=time.monotonic() + 1.0)
            except Exception:  # noqa: BLE001 - etcd unreachable at exit: the others see a lease expire
                pass
        # Store calls of tdx's failure notes (C++ threads) still in flight must end while Python runs.
        from .. import _C

        deadline = time.monotonic() + self.ttl
        while _C.pending_store_calls() and time.monotonic() < deadline:
            time.sleep(0.02)
        watcher = getattr(self.client, "_stubs", {}).get("watcher")
        if watcher is not None:
            watcher.close()
            thread = getattr(watcher, "_callback_thread", None)
            if thread is not None:
                thread.join(timeout=1.0)

    # -------------------------------------------------------------- etcd: the keys

    def _rank_of(self, key):
        key = key.decode() if isinstance(key, bytes) else key
        tail = key[len(self.store._key(self.alive)):]
        return int(tail) if tail.isdigit() else None

    def _seen(self, rank, raw):
        if rank is None or rank == self.rank:
            return
        try:
            info = json.loads(raw)
        except (ValueError, TypeError):
            return  # a key of another format (an older peer): no connection, its lease still counts
        with self.mu:
            new = rank not in self.info
            self.info[rank] = info
            self.gone.pop(rank, None)
            self.interrupted.discard(rank)
            if new and info.get("host") != self.host:
                self.pending.append(rank)
        if new:
            self.wake_w.send(b"x")

    def _resync(self):
        """Every liveness key now; the known ranks without one are deleted. Returns etcd's revision."""
        response = self.store._call("liveness keys", self.client.get_prefix_response, self.store._key(self.alive),
                                    deadline=time.monotonic() + self.ttl)
        present = set()
        for kv in response.kvs:
            rank = self._rank_of(kv.key)
            present.add(rank)
            self._seen(rank, kv.value)
        with self.mu:
            missing = [r for r in self.info if r not in present and r not in self.gone]
        for r in missing:
            self._deleted(r)
        return response.header.revision

    def why_gone(self, rank):
        """Why ``rank``'s liveness key is gone: this generation's ``tdx/ended/g<g>/<rank>``, which
        whoever revokes a lease writes first (a peer that saw the process end, the ranks that excluded
        it: ``end``), or "left" (a clean exit); without one, its lease expired."""
        return self.end_note(rank)[1]

    def end_note(self, rank):
        """(the end note of ``rank`` or None, why its key is gone in words)."""
        with self.mu:
            host = self.info.get(rank, {}).get("host", "?")
        try:
            ended, _ = self.store._call("liveness end", self.client.get, self.store._key(f"{self.ended}{rank}"),
                                        deadline=time.monotonic() + self.ttl)
        except Exception as e:  # noqa: BLE001 - no member answers: say so rather than guess (counted silent)
            return None, (f"its liveness key in etcd is gone (its lease expired or a peer revoked it; etcd did not "
                          f"say which within {self.ttl:g} s: {type(e).__name__}; its host is '{host}')")
        if ended is not None:
            return ended.decode(), ended.decode()
        return None, (f"its liveness lease in etcd expired (no refresh for {self.ttl:g} s, TDX_FAILURE_DETECTION_S; "
                      f"its host '{host}' died or was cut off)")

    def _deleted(self, rank):
        """Rank's liveness key is gone: unless it left, interrupt the groups that hold it."""
        if rank is None or rank == self.rank or self.retired:
            return
        ended, why = self.end_note(rank)
        if ended == _LEFT:
            with self.mu:
                self.info.pop(rank, None)
            return
        if ended is None:
            with self.mu:
                self.silent.add(rank)
        self._gone(rank, why)

    def _gone(self, rank, why):
        if self.retired:
            return  # its ranks are numbered as in an older generation: nothing of now to interrupt
        with self.mu:
            self.gone.setdefault(rank, why)
            if rank in self.interrupted:
                return
            self.interrupted.add(rank)
            silent = dict(self.gone)
        for ranks, backend in _group_backends():
            if rank in ranks and self.rank in ranks:
                reason = "; ".join(f"global rank {r}: {w}" for r, w in sorted(silent.items()) if r in ranks)
                try:
                    backend.interrupt(reason)
                except Exception:  # noqa: BLE001 - a group shut down meanwhile
                    pass

    def _watch_loop(self):
        watch_id, broken, revision = None, threading.Event(), None

        def on_event(response):
            if isinstance(response, Exception):
                broken.set()
                return
            if self.retired:
                return
            for event in response.events:
                rank = self._rank_of(event.key)
                if type(event).__name__ == "DeleteEvent":
                    threading.Thread(target=self._deleted, args=(rank,), daemon=True).start()
                else:
                    self._seen(rank, event.value)

        period = min(0.5, self.ttl / 10)
        while not self.stopped:
            try:
                revision = self._resync()
                if not self.stopped and (watch_id is None or broken.is_set()):
                    if watch_id is not None:
                        try:
                            self.client.cancel_watch(watch_id)
                        except Exception:  # noqa: BLE001
                            pass
                    broken.clear()
                    watch_id = self.client.add_watch_prefix_callback(self.store._key(self.alive), on_event,
                                                                     start_revision=revision + 1)
            except Exception:  # noqa: BLE001 - no member answers now: look again
                pass
            time.sleep(period)
        if self.retired and watch_id is not None:
            try:
                self.client.cancel_watch(watch_id)
            except Exception:  # noqa: BLE001 - etcd unreachable: the stream ends with the process
                pass

    # -------------------------------------------------------------- the connections

    def _connect(self, rank):
        with self.mu:
            info = self.info.get(rank)
        if info is None or rank in self.conns:
            return
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(min(1.0, self.ttl))
        try:
            sock.connect((info["addr"], int(info["port"])))
        except ConnectionRefusedError:
            sock.close()
            self._ended(rank, f"its process is gone: its host '{info['host']}' refused a connection to its "
                              "liveness port")
            return
        except OSError:
            sock.close()  # silent (a link cut): its lease tells
            return
        sock.setblocking(False)
        self.conns[rank] = sock
        self.selector.register(sock, selectors.EVENT_READ, rank)

    def _ended(self, rank, why):
        """A positive sign that rank's process ended (it did not say "left" first): interrupt this
        process's groups holding it at once, then say why in etcd (the first to tell wins) and
        revoke its lease, so that its key goes at once for every rank."""
        with self.mu:
            if rank in self.left or self.retired:
                return
            info = self.info.get(rank, {})
        self._gone(rank, why)
        self.end(rank, why, info.get("lease"))

    def end(self, rank, why, lease):
        """Writes this generation's ``tdx/ended/g<g>/<rank>`` (``why``; the first to tell wins), then
        revokes ``lease``, the rank's (None: not known here): whoever sees its key go reads the note,
        so a revoke is never told as an expiry."""
        key = self.store._key(f"{self.ended}{rank}")
        tx = self.client.transactions
        try:
            self.store._call("liveness end", self.client.transaction, compare=[tx.version(key) == 0],
                             success=[tx.put(key, why.encode())], failure=[], deadline=time.monotonic() + self.ttl)
            if lease is not None:
                self.store._call("liveness revoke", self.client.revoke_lease, lease,
                                 deadline=time.monotonic() + self.ttl)
        except Exception:  # noqa: BLE001 - revoked already, or etcd unreachable: the lease expires
            pass

    def _conn_loop(self):
        while not self.retired:  # a retired watch's sockets stay open (closing them would tell an end)
            with self.mu:
                pending, self.pending = self.pending, []
            for rank in pending:
                self._connect(rank)
            for key, _ in self.selector.select(timeout=1.0):
                if key.fileobj is self.wake_r:
                    self.wake_r.recv(4096)
                elif key.data == "accept":
                    try:
                        conn, _ = self.listener.accept()
                        conn.setblocking(False)
                        self.accepted.append(conn)
                        self.selector.register(conn, selectors.EVENT_READ, "peer")
                    except OSError:
                        pass
                elif key.data == "peer":  # a peer's connection to us: kept open, nothing read
                    try:
                        if not key.fileobj.recv(4096):
                            self.selector.unregister(key.fileobj)
                            key.fileobj.close()
                    except OSError:
                        self.selector.unregister(key.fileobj)
                        key.fileobj.close()
                else:
                    self._on_readable(key.data, key.fileobj)

    def _on_readable(self, rank, sock):
        try:
            data = sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            if _LEFT.encode() in data:  # a clean exit: its end is no failure
                with self.mu:
                    self.left.add(rank)
            return
        self.selector.unregister(sock)
        sock.close()
        self.conns.pop(rank, None)
        with self.mu:
            host = self.info.get(rank, {}).get("host", "?")
        threading.Thread(target=self._ended, args=(rank, f"its process ended: its liveness connection closed "
                                                         f"(host '{host}')"), daemon=True).start()

    # -------------------------------------------------------------- for gone_ranks

    def known_gone(self, global_ranks):
        """{global rank: why} of ``global_ranks`` whose key was deleted (not a clean exit)."""
        with self.mu:
            return {r: self.gone[r] for r in global_ranks if r in self.gone}

    def probe_hosts(self, hosts, global_ranks):
        """Connects once to the liveness port of ``global_ranks`` on ``hosts`` (the hosts a failure
        named): a refused connection confirms the rank's end at once."""
        with self.mu:
            targets = [r for r in global_ranks if self.info.get(r, {}).get("host") in hosts and r not in self.gone]
            infos = {r: dict(self.info[r]) for r in targets}
        for r in targets:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.settimeout(0.2)
            try:
                sock.connect((infos[r]["addr"], int(infos[r]["port"])))
            except ConnectionRefusedError:
                self._ended(r, f"its process is gone: its host '{infos[r]['host']}' refused a connection to its "
                               "liveness port")
            except OSError:
                pass
            finally:
                sock.close()

    def settle(self, global_ranks, quiet=0.2, limit=1.0):
        """Once a rank of ``global_ranks`` is known gone: the ranks of its host tend to end together
        (a host's processes killed one after the other), and the survivors must agree on whom to
        exclude. Probes the other ranks of those hosts, then waits until no further rank was told
        gone for ``quiet`` seconds (at most ``limit``); when one went silent (its lease expired),
        until the rest of its host is gone too, at most TDX_FAILURE_DETECTION_S / 3 + 1 s."""
        with self.mu:
            hosts = {self.info.get(r, {}).get("host") for r in global_ranks if r in self.gone}
        self.probe_hosts(hosts - {None}, global_ranks)
        started = changed = time.monotonic()
        count = len(self.known_gone(global_ranks))
        while time.monotonic() - changed < quiet and time.monotonic() - started < limit:
            time.sleep(0.02)
            now = len(self.known_gone(global_ranks))
            if now != count:
                count, changed = now, time.monotonic()
        # A host cut off tells nothing: its ranks' leases expire one by one, up to one refresh period
        # (TDX_FAILURE_DETECTION_S / 3) apart. When a rank went silent, give the rest of its host that
        # long (and a margin for etcd's expiry) to go silent too, so that every survivor excludes them
        # together; the ones that stay are alive (a stopped rank's host mates).
        # A host killed whole ends its ranks one by one too (each told by its own closed connection):
        # the same wait, so that no survivor excludes only part of it while another excludes all.
        with self.mu:
            silent_hosts = {self.info.get(r, {}).get("host") for r in global_ranks if r in self.gone} - {None}
        deadline = time.monotonic() + self.ttl / 3 + 1.0
        while silent_hosts and time.monotonic() < deadline:
            with self.mu:
                waiting = [r for r in global_ranks if r != self.rank and r not in self.gone
                           and self.info.get(r, {}).get("host") in silent_hosts]
            if not waiting:
                break
            time.sleep(0.05)
