"""The server role: a shard of the parameters and of the optimizer state, updated by pushes."""
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
from ._layout import ShardPlan, describe, explain_mismatch
from ._protocol import HEADER, next_tags, post_description, receive_description, wait_quietly
from .config import PSConfig

__all__ = ["ParameterServer", "ServerStats", "serve"]


@dataclass
class ServerStats:
    """What one server did, returned by ``ParameterServer.run``."""

    rank: int
    """This server's rank."""
    updates: int = 0
    """Optimizer steps taken on this shard."""
    pushes: int = 0
    """Gradient pushes received."""
    staleness: Dict[int, int] = field(default_factory=dict)
    """Histogram of push staleness: the pushing worker's clock minus the slowest live worker's clock."""
    finished: List[int] = field(default_factory=list)
    """Worker ranks that said they were done."""
    lost: Dict[int, str] = field(default_factory=dict)
    """Worker ranks that died, with the backend's message."""
    seconds: float = 0.0
    """Wall time of ``run``."""


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
        self._ran = False
        named = list(module.named_parameters())
        self.plan = ShardPlan(named, self.config.num_servers, f"ps.ParameterServer rank {self.rank}")
        self._desc = describe(self.plan, self.config.code())
        k, n = self.rank, self.plan.numels[self.rank]
        self.flat = torch.zeros(n)
        for view, i in zip(self.plan.views(self.flat, k), self.plan.members[k]):
            view.copy_(named[i][1].detach())
        self._recv = torch.zeros(HEADER + n)
        self._acc = torch.zeros(n)
        grad_base, start = (self._acc, 0) if self.config.effective_mode == "sync" else (self._recv, HEADER)
        self.params = []
        for view, grad, i in zip(self.plan.views(self.flat, k), self.plan.views(grad_base, k, start),
                                 self.plan.members[k]):
            p = nn.Parameter(view, requires_grad=named[i][1].requires_grad)  # shares the flat shard's storage
            if p.requires_grad:
                p.grad = grad  # frozen parameters keep no gradient: optimizers skip them
            self.params.append(p)
        self.optimizer = optimizer_class(self.params, **defaults)
        self._reply = {w: torch.zeros(HEADER + n) for w in self.workers}
        self._sends = {}
        self._events = queue.Queue()

    def named_parameters(self):
        """(name, tensor) of the parameters this server holds (views of its flat shard)."""
        return [(self.plan.names[i], p) for i, p in zip(self.plan.members[self.rank], self.params)]

    def run(self) -> ServerStats:
        """Serves until every worker has finished or died; returns this server's ``ServerStats``.

        Raises ValueError if a worker's model or ``PSConfig`` differs from this server's.
        """
        if self._ran:
            raise RuntimeError("ps.ParameterServer.run: a server runs once; build a new one (and new Workers)")
        self._ran = True
        t0 = time.perf_counter()
        self.stats = ServerStats(self.rank)
        self.clocks = Clocks(self.workers, self.config.effective_mode, self.config.staleness)
        self._handshake()
        for w in self.workers:
            bye = torch.zeros(1)
            self._watch(dist.irecv(bye, src=w, tag=self._tags.bye), ("bye", w, bye))
        for w in list(self.clocks.live):
            self._send_reply(w)
        self._post_push()
        failures = 0
        while self.clocks.live:
            (kind, w, _), err = self._events.get()
            if kind == "bye":
                self._remove(w, err)
            elif err:
                failures += 1  # a worker died in the middle of a push: its BYE receive names it
                if failures > 2 * len(self.workers):
                    raise RuntimeError(f"ps server rank {self.rank}: receiving pushes keeps failing: {err}")
                self._post_push()
            else:
                self._take_push()
                self._post_push()
        for w in self._sends:
            wait_quietly(self._sends[w])
        self.stats.staleness = dict(sorted(self.clocks.staleness.items()))
        self.stats.seconds = time.perf_counter() - t0
        return self.stats

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
                self._events.put((what, ""))
            except Exception as e:  # noqa: BLE001 - reported by the loop
                self._events.put((what, str(e)))

        try:
            fut = work.get_future()
        except RuntimeError:  # a Work without a future (tdx across hosts: Gloo's p2p): wait in a thread
            threading.Thread(target=report, args=(work.wait,), daemon=True, name="tdx-ps-wait").start()
            return
        fut.add_done_callback(lambda f: report(f.wait))

    def _post_push(self):
        self._watch(dist.irecv(self._recv, src=None, tag=self._tags.push), ("push", None, None))

    def _take_push(self):
        clock, w = int(self._recv[0].item()), int(self._recv[1].item())
        self.stats.pushes += 1
        if w not in self.clocks.live:
            return  # the last push of a worker already reported lost
        if self.config.effective_mode == "sync":
            self._acc.add_(self._recv[HEADER:])
        if self.clocks.push(w, clock):
            self._step()
        for v in self.clocks.release():
            self._send_reply(v)

    def _step(self):
        if self.config.effective_mode == "sync":
            self._acc.div_(self.clocks.take_pending())
        self.optimizer.step()
        if self.config.effective_mode == "sync":
            self._acc.zero_()
        self.stats.updates += 1

    def _remove(self, w, err):
        if w not in self.clocks.live:
            return
        if err:
            self.stats.lost[w] = err
            warnings.warn(f"ps server rank {self.rank}: worker rank {w} was lost; training goes on without it: "
                          f"{err}", RuntimeWarning, stacklevel=2)
        else:
            self.stats.finished.append(w)
        if self.clocks.remove(w):
            self._step()
        for v in self.clocks.release():
            self._send_reply(v)

    def _send_reply(self, w):
        wait_quietly(self._sends.get(w))  # the previous reply to w has long left; a dead w's fails
        buf = self._reply[w]
        buf[0], buf[1], buf[2] = self.stats.updates, len(self.clocks.live), self.clocks.min_live()
        buf[HEADER:].copy_(self.flat)
        self._sends[w] = dist.isend(buf, w, tag=self._tags.reply)


def serve(module: nn.Module, optimizer_class, config: Optional[PSConfig] = None, **defaults) -> ServerStats:
    """``ParameterServer(module, optimizer_class, config, **defaults).run()``: serve until the workers are done."""
    return ParameterServer(module, optimizer_class, config, **defaults).run()
