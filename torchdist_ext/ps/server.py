"""The server role: a shard of the parameters and of the optimizer state, updated by pushes."""
import io
import queue
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ._clocks import Clocks
from ._layout import ShardPlan, describe, explain_mismatch, sparse_parameter_names
from ._protocol import (APPLIED, CONTROL, FAILED, HEADER, LIVE, OK, PULL, PUSH, ROWS, SLOWEST, STATE, STATUS,
                        UPDATES, counters, lr_word, next_tags, post_description, receive_description,
                        replica_tags, wait_quietly)
from ._replicas import job_holders
from ._state import load_server_state, server_state
from .config import PSConfig

__all__ = ["ParameterServer", "ServerStats", "serve"]


@dataclass
class ServerStats:
    """What one server did, returned by ``ParameterServer.run``."""

    rank: int
    """This server's rank."""
    shard: int = -1
    """The shard this copy holds (the rank of the server it belongs to; -1: this server's own)."""
    updates: int = 0
    """Optimizer steps taken on this shard."""
    pushes: int = 0
    """Gradient pushes received."""
    applied: int = 0
    """Gradient pushes in this copy's parameters (under "sync" a step applies the mean of several)."""
    staleness: Dict[int, int] = field(default_factory=dict)
    """Histogram of push staleness: the pushing worker's clock minus the slowest live worker's clock."""
    finished: List[int] = field(default_factory=list)
    """Worker ranks that said they were done."""
    lost: Dict[int, str] = field(default_factory=dict)
    """Worker ranks that died, with the backend's message."""
    seconds: float = 0.0
    """Wall time of ``run``."""
    replica: Optional["ServerStats"] = None
    """With ``PSConfig(replicate=True)``: the stats of the replica this server held (of shard
    ``replica.shard``), which served that shard's workers in full once its server died."""


class ParameterServer:
    """Holds one shard of ``module``'s parameters and runs ``optimizer_class`` on it.

    Every rank builds the same module; ranks ``0 .. config.num_servers - 1`` build a
    ``ParameterServer`` and call ``run()``, the others wrap the module in ``ps.Worker``. The
    initial parameters are this server's module's: workers pull them at start.

    Args:
        module: the model (the same architecture as the workers'); its float32 parameters are
            copied into this server's flat shard (parameters are assigned whole to servers,
            balanced by bytes).
        optimizer_class: any ``torch.optim.Optimizer`` class (or a callable ``(params, **defaults)``);
            it sees this shard's parameters with their own shapes, so per-tensor rules hold.
        config: a ``PSConfig`` (the same on every rank); default ``PSConfig()``.
        **defaults: keyword arguments of ``optimizer_class`` (lr, momentum, ...).

    With ``config.replicate``, this server also holds the replica of one other server's shard
    (``self.replica``, a ``ParameterServer`` of that shard with its own optimizer), applies every push
    of that shard as its server does, and serves it in full to the workers that switch to it when its
    server dies. Building it is collective over the default group (the servers' host names).
    """

    def __init__(self, module: nn.Module, optimizer_class, config: Optional[PSConfig] = None, **defaults):
        if not dist.is_initialized():
            raise RuntimeError("ps.ParameterServer: call torch.distributed.init_process_group first")
        self.config = config or PSConfig()
        self.rank, world = dist.get_rank(), dist.get_world_size()
        if not self.config.is_server(self.rank, world):
            raise ValueError(f"ps.ParameterServer: rank {self.rank} is a worker (num_servers="
                             f"{self.config.num_servers}: ranks 0..{self.config.num_servers - 1} serve); "
                             "build ps.Worker on this rank")
        self.workers = self.config.worker_ranks(world)
        self._tags = next_tags()
        self._setup(module, optimizer_class, self.rank, defaults)
        self.replica, self.holder = None, None
        if self.config.replicate:
            holders = job_holders(self.config.num_servers)
            self.holder = holders[self.rank]
            replica = ParameterServer.__new__(ParameterServer)
            replica.config, replica.rank, replica.workers = self.config, self.rank, self.workers
            replica._tags = replica_tags(self._tags)
            replica._setup(module, optimizer_class, holders.index(self.rank), defaults)
            replica.replica, replica.holder = None, None
            self.replica = replica

    def _setup(self, module, optimizer_class, shard, defaults):
        """Builds the copy of shard ``shard`` (this server's own, or the one it keeps a replica of)."""
        self.shard = shard
        self._ran = False
        named = list(module.named_parameters())
        self.plan = ShardPlan(named, self.config.num_servers, f"ps.ParameterServer rank {self.rank}",
                              self.config.split_bytes, sparse_parameter_names(module))
        self._desc = describe(self.plan, self.config.code())
        k, n = shard, self.plan.numels[shard]
        self.pieces = self.plan.pieces[k]
        self.flat = torch.zeros(n)
        # A PUSH's dense gradient lands in its worker's inbox, whose receive is posted before the
        # push comes, so the data goes from the transport into place with no staging copy.
        self._inbox = {w: torch.zeros(n) for w in self.workers} if n else {}
        self._inbox_works = {}
        sync = self.config.effective_mode == "sync"
        self._acc = torch.zeros(n)  # "sync": the sum of this step's pushes ("async"/"ssp": unused)
        dense_views = iter(zip(self.plan.views(self.flat, k), self.plan.views(self._acc, k)))
        self.params, self._sparse, self._dense_trained = [], {}, []
        for piece in self.pieces:
            src = named[piece.index][1].detach()
            src = src if piece.whole else src[piece.rows[0]:piece.rows[1]]
            requires_grad = named[piece.index][1].requires_grad
            if piece.offset >= 0:
                view, grad = next(dense_views)
                view.copy_(src)
                p = nn.Parameter(view, requires_grad=requires_grad)  # shares the flat shard's storage
                if requires_grad:
                    p.grad = grad  # frozen parameters keep no gradient: optimizers skip them
                    self._dense_trained.append((p, len(self.params)))
            else:
                p = nn.Parameter(src.clone(), requires_grad=requires_grad)
                self._sparse[piece] = p
            self.params.append(p)
        dense_pos = [i for i, pc in enumerate(self.pieces) if pc.offset >= 0]
        # "async"/"ssp": per worker, views of its inbox shaped as the trained dense parameters
        self._inbox_grads = {} if sync else {
            w: [views[dense_pos.index(i)] for _, i in self._dense_trained]
            for w, views in ((w, self.plan.views(buf, k)) for w, buf in self._inbox.items())}
        self.optimizer = optimizer_class(self.params, **defaults)
        self._sparse_acc = {piece: [] for piece in self._sparse}  # "sync": (ids, rows) pushed this step
        self._lrs = []  # "sync": the learning rate of each push of this step
        self._reply = {w: torch.zeros(HEADER + n) for w in self.workers}
        # workers that get full replies: all of them from a server's own shard, from a replica those
        # that switched to it (the others get the header, an acknowledgement)
        self._full = set(self.workers) if shard == self.rank else set()
        self._pushed = []  # "sync": the workers whose pushes this step sums (in rank order)
        self._control = torch.zeros(CONTROL, dtype=torch.float64)
        self._sends = {}
        self._events = queue.Queue()
        self._updates0 = 0
        self._failures = 0

    def named_parameters(self):
        """(name, tensor) of the parameters this server holds; a piece of a parameter split by rows is
        named ``"name[start:stop]"``."""
        return [(self.plan.names[pc.index] + ("" if pc.whole else f"[{pc.rows[0]}:{pc.rows[1]}]"), p)
                for pc, p in zip(self.pieces, self.params)]

    def state_dict(self):
        """This server's part of a checkpoint (its pieces, their optimizer state, its update count and the
        workers' clocks); ``ps.state_dict(worker)`` merges every server's into one server-count-free dict."""
        return server_state(self)

    def load_state_dict(self, state):
        """Takes this server's pieces, their optimizer state and the update count from ``state`` (what
        ``ps.load`` returns, saved with any server or worker count). Call before ``run()``.

        Raises ValueError naming the parameters missing from ``state``, unexpected, or of another shape.
        """
        if self._ran:
            raise RuntimeError("ps.ParameterServer.load_state_dict: call it before run()")
        self._updates0 = load_server_state(self, state)
        if self.replica is not None:
            self.replica.load_state_dict(state)

    def run(self) -> ServerStats:
        """Serves until every worker has finished or died; returns this server's ``ServerStats``
        (with ``replicate``, the replica's in ``.replica``).

        Raises ValueError if a worker's model or ``PSConfig`` differs from this server's. If serving
        raises, every live worker is told this server failed (so it switches to the replica, or
        raises ``ServerFailedError``) before the exception propagates.
        """
        if self._ran:
            raise RuntimeError("ps.ParameterServer.run: a server runs once; build a new one (and new Workers)")
        t0 = time.perf_counter()
        copies = [self] if self.replica is None else [self, self.replica]
        events = queue.Queue()  # one loop serves both copies
        for c in copies:
            c._ran, c._events = True, events
            c.stats = ServerStats(self.rank, shard=c.shard, updates=c._updates0)
            c.clocks = Clocks(self.workers, self.config.effective_mode, self.config.staleness)
        try:
            for c in copies:
                c._handshake()
            if self.replica is not None:
                self._seed_replicas()
            for c in copies:
                c._start()
            while any(c.clocks.live for c in copies):
                c, (kind, w, _), err = events.get()
                c._on_event(kind, w, err)
        except BaseException:
            for c in copies:
                c._announce_failure()
            raise
        for c in copies:
            for w in c._sends:
                for work, _ in c._sends[w]:
                    wait_quietly(work)
            c.stats.staleness = dict(sorted(c.clocks.staleness.items()))
            c.stats.seconds = time.perf_counter() - t0
        self.stats.replica = None if self.replica is None else self.replica.stats
        return self.stats

    def _seed_replicas(self):
        """Sends this shard's values to the server holding its replica and takes the replicated
        shard's from its server, so both copies start equal whatever each rank's module held."""
        tag = self.replica._tags.seed
        mine = [t for t in (self.flat, *(p.detach() for p in self._sparse.values())) if t.numel()]
        theirs = [t for t in (self.replica.flat, *(p.detach() for p in self.replica._sparse.values())) if t.numel()]
        works = [dist.isend(t, self.holder, tag=tag) for t in mine]
        for t in theirs:
            dist.recv(t, self.replica.shard, tag=tag)
        for work in works:
            work.wait()

    def _start(self):
        for w in self.workers:
            bye = torch.zeros(1)
            self._watch(dist.irecv(bye, src=w, tag=self._tags.bye), ("bye", w, bye))
        for w in list(self.clocks.live):
            self._post_inbox(w)
            self._send_reply(w)
        self._post_control()

    def _on_event(self, kind, w, err):
        if kind == "bye":
            self._remove(w, err)
        elif err:
            self._failures += 1  # a worker died in the middle of a request: its BYE receive names it
            if self._failures > 2 * len(self.workers):
                raise RuntimeError(f"ps server rank {self.rank}: receiving requests keeps failing: {err}")
            self._post_control()
        else:
            self._take_control()
            self._post_control()

    def _announce_failure(self):
        """Sends every live worker a REPLY with status FAILED, of the size it expects, so that a worker
        of a server whose process outlives the exception switches to the replica (or raises) instead
        of waiting; waits up to a second for them to leave."""
        if not hasattr(self, "clocks"):
            return
        self._failed_sends = []
        for w in sorted(self.clocks.live):
            buf = torch.zeros(HEADER + (self.flat.numel() if w in self._full else 0))
            counters(buf)[STATUS] = FAILED
            try:
                self._failed_sends.append((dist.isend(buf, w, tag=self._tags.reply), buf))
            except Exception:  # noqa: BLE001 - that worker is gone: nothing to tell
                pass
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and not all(wk.is_completed() for wk, _ in self._failed_sends):
            time.sleep(0.005)

    def _handshake(self):
        keep = [post_description(self._desc, w, self._tags) for w in self.workers]
        bad = []
        for w in self.workers:
            try:
                theirs = receive_description(w, self._tags)
            except Exception as e:  # noqa: BLE001 - a worker that died before starting is lost
                self._remove(w, str(e))
                continue
            why = explain_mismatch(self._desc, theirs, f"server rank {self.rank}", f"worker rank {w}",
                                   self.plan.names)
            if why:
                bad.append(why)
        for works, _ in keep:
            for work in works:
                wait_quietly(work)
        if bad:
            raise ValueError("ps.ParameterServer: a worker's model does not match this server's layout: "
                             + "; ".join(bad) + ". Build the same module and PSConfig on every rank")

    def _watch(self, work, what):
        """Puts (what, error text or "") on the event queue when ``work`` completes."""
        def report(wait):
            try:
                wait()
                self._events.put((self, what, ""))
            except Exception as e:  # noqa: BLE001 - reported by the loop
                self._events.put((self, what, str(e)))

        try:
            fut = work.get_future()
        except RuntimeError:  # a Work without a future (tdx across hosts: Gloo's p2p): wait in a thread
            threading.Thread(target=report, args=(work.wait,), daemon=True, name="tdx-ps-wait").start()
            return
        fut.add_done_callback(lambda f: report(f.wait))

    def _post_inbox(self, w):
        """Posts the receive of worker ``w``'s next dense gradient into its inbox."""
        if self._inbox:
            self._inbox_works[w] = dist.irecv(self._inbox[w], src=w, tag=self._tags.grads)

    def _post_control(self):
        self._watch(dist.irecv(self._control, src=None, tag=self._tags.control), ("control", None, None))

    def _take_control(self):
        kind, w, clock, lr, words, table, full = self._control.tolist()
        w, words = int(w), int(words)
        if w not in self.clocks.live:
            return  # the last request of a worker already reported lost
        if full:
            self._full.add(w)  # a replica's worker switched to it: full replies from now on
        try:
            if kind == PULL:
                self._send_reply(w)
            elif kind == PUSH:
                self._take_push(w, int(clock), lr, words)
            elif kind == ROWS:
                self._send_rows(w, int(table), words)
            elif kind == STATE:
                self._send_state(w)
            else:
                raise RuntimeError(f"ps server rank {self.rank}: worker rank {w} sent an unknown request {kind}")
        except _WorkerLost as e:
            self._remove(w, str(e))

    def _recv_from(self, w, tensor, tag):
        try:
            dist.recv(tensor, src=w, tag=tag)
        except Exception as e:  # noqa: BLE001 - the worker died between its request and the data
            raise _WorkerLost(str(e)) from e
        return tensor

    def _take_push(self, w, clock, lr, words):
        self.stats.pushes += 1
        if self._inbox:
            err = wait_quietly(self._inbox_works.pop(w))
            if err:  # the worker died between its request and its gradient
                raise _WorkerLost(err)
        sparse = self._recv_sparse(w, words)
        sync = self.config.effective_mode == "sync"
        if sync:
            self._pushed.append(w)  # summed at the step in rank order, so every copy adds alike
            for piece, got in sparse.items():
                self._sparse_acc[piece].append((w, got))
            self._lrs.append(lr)
        else:
            for (p, _), g in zip(self._dense_trained, self._inbox_grads.get(w, ())):
                p.grad = g
            for piece, (ids, rows) in sparse.items():
                _set_sparse_grad(self._sparse[piece], ids, rows, 1)
            self._lrs = [lr]
        if self.clocks.push(w, clock):
            self._step()
        if not sync:
            self._post_inbox(w)  # the step has read the inbox
        for v in self.clocks.release():
            self._send_reply(v)

    def _recv_sparse(self, w, words):
        """The (local ids, gradient rows) per sparse piece of a PUSH from ``w``."""
        if not self._sparse:
            return {}
        ids = self._recv_from(w, torch.empty(words, dtype=torch.int64), self._tags.ids)
        counts = ids[:len(self._sparse)].tolist()
        dims = [self.plan.piece_shape(piece)[1:] for piece in self._sparse]
        n_rows = sum(c * _prod(d) for c, d in zip(counts, dims))
        rows = self._recv_from(w, torch.empty(n_rows), self._tags.rows) if n_rows else torch.empty(0)
        out, pos, rpos = {}, len(self._sparse), 0
        for piece, c, d in zip(self._sparse, counts, dims):
            out[piece] = (ids[pos:pos + c], rows[rpos:rpos + c * _prod(d)].view(c, *d))
            n_rows = self.plan.piece_shape(piece)[0]
            if c and not (0 <= int(out[piece][0].min()) and int(out[piece][0].max()) < n_rows):
                raise RuntimeError(f"ps server rank {self.rank}: worker rank {w} pushed rows outside 0..{n_rows - 1} "
                                   f"of {self.plan.names[piece.index]} (a worker of another build?)")
            pos += c
            rpos += c * _prod(d)
        return out

    def _send_rows(self, w, table, words):
        piece = next((pc for pc in self._sparse if pc.index == table), None)
        ids = self._recv_from(w, torch.empty(words, dtype=torch.int64), self._tags.ids)
        if piece is None:
            raise RuntimeError(f"ps server rank {self.rank}: worker rank {w} asked for rows of parameter {table}, "
                               "which this server holds no sparse piece of")
        rows = self._sparse[piece].detach().index_select(0, ids)
        self._send(w, [rows], self._tags.rows)

    def _send_state(self, w):
        buf = io.BytesIO()
        torch.save(self.state_dict(), buf)
        data = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        self._send(w, [torch.tensor([data.numel()], dtype=torch.int64), data], self._tags.state)

    def _send(self, w, tensors, tag):
        """Sends ``tensors`` to ``w`` after its previous message left; the works keep them alive."""
        for work, _ in self._sends.pop(w, []):
            wait_quietly(work)  # the previous message to w has long left; a dead w's fails
        self._sends[w] = [(dist.isend(t, w, tag=tag), t) for t in tensors]

    def _step(self):
        sync = self.config.effective_mode == "sync"
        lr = sum(self._lrs) / len(self._lrs)
        if sync:
            n = self.clocks.take_pending()
            pushed, self._pushed = sorted(self._pushed), []
            for w in pushed if self._inbox else ():
                self._acc.add_(self._inbox[w])
                if w in self.clocks.live:
                    self._post_inbox(w)  # its next gradient comes only after this step's reply
            self._acc.div_(n)
            for piece, got in self._sparse_acc.items():
                got = [g for _, g in sorted(got, key=lambda wg: wg[0])]
                ids = torch.cat([g[0] for g in got]) if got else torch.empty(0, dtype=torch.int64)
                rows = torch.cat([g[1] for g in got]) if got else torch.empty(0, *self.plan.piece_shape(piece)[1:])
                _set_sparse_grad(self._sparse[piece], ids, rows, n)
                self._sparse_acc[piece] = []
            if len(set(self._lrs)) > 1 and not self._warned_lr:
                self._warned_lr = True
                warnings.warn(f"ps server rank {self.rank}: the workers' pushes of one synchronous step carry "
                              f"different learning rates {sorted(set(self._lrs))}; applying their mean {lr}. "
                              "Step the same schedule on every worker", RuntimeWarning, stacklevel=2)
        self._lrs = []
        for group in self.optimizer.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self.optimizer.step()
        if sync:
            self._acc.zero_()
        for p in self._sparse.values():
            p.grad = None
        self.stats.updates += 1
        self.stats.applied += n if sync else 1

    _warned_lr = False

    def _remove(self, w, err):
        if w not in self.clocks.live:
            return
        if err:
            self.stats.lost[w] = err
            if self.shard == self.rank:  # said once per server, not again by the replica it holds
                warnings.warn(f"ps server rank {self.rank}: worker rank {w} was lost; training goes on without "
                              f"it: {err}", RuntimeWarning, stacklevel=2)
        else:
            self.stats.finished.append(w)
        if self.clocks.remove(w):
            self._step()
        for v in self.clocks.release():
            self._send_reply(v)

    def _send_reply(self, w):
        buf = self._reply[w]
        for work, _ in self._sends.pop(w, []):
            wait_quietly(work)
        c = counters(buf)
        c[UPDATES], c[LIVE], c[SLOWEST] = self.stats.updates, len(self.clocks.live), self.clocks.min_live()
        c[APPLIED], c[STATUS] = self.stats.applied, OK
        lr_word(buf)[0] = float(self.optimizer.param_groups[0]["lr"])
        if w in self._full:
            buf[HEADER:].copy_(self.flat)
            self._send(w, [buf], self._tags.reply)
        else:
            self._send(w, [buf[:HEADER]], self._tags.reply)


class _WorkerLost(Exception):
    """A worker died between a request and the data that goes with it."""


def _prod(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def _set_sparse_grad(param, ids, rows, n):
    """Gives ``param`` the sparse COO gradient ``rows`` at ``ids`` (duplicates summed) divided by n, as
    ``nn.Embedding(sparse=True)`` would; a frozen parameter gets none."""
    if param.requires_grad:
        grad = torch.sparse_coo_tensor(ids.view(1, -1), rows / n if n != 1 else rows, param.shape,
                                       check_invariants=False)  # the ids were checked on arrival
        param.grad = grad.coalesce()


def serve(module: nn.Module, optimizer_class, config: Optional[PSConfig] = None, **defaults) -> ServerStats:
    """``ParameterServer(module, optimizer_class, config, **defaults).run()``: serve until the workers are done."""
    return ParameterServer(module, optimizer_class, config, **defaults).run()
