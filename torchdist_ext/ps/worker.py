"""The worker role: an unchanged training loop whose optimizer step pushes gradients and pulls."""
import os
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ._layout import ShardPlan, describe, explain_mismatch
from ._protocol import HEADER, next_tags, post_description, receive_description, wait_quietly
from .config import PSConfig

__all__ = ["Worker", "PushOptimizer", "ServerFailedError"]


class ServerFailedError(RuntimeError):
    """A parameter server a worker depends on died or stopped answering; ``server_rank`` names it."""

    def __init__(self, msg, server_rank):
        super().__init__(msg)
        self.server_rank = server_rank


class Worker(nn.Module):
    """Wraps ``module`` on a worker rank: forward is the module's, ``step()`` pushes and pulls.

    At construction the worker checks that its model and ``PSConfig`` match every server's
    (ValueError naming the first difference otherwise) and pulls the servers' parameters, so all
    workers start from the same values. The module's parameters become views of the pulled shards:
    a pull updates them in place (on CUDA, the pull lands in host memory and is copied to the GPU).

    Args:
        module: the model; float32 parameters, on the CPU or on ``device``.
        config: the job's ``PSConfig`` (the same on every rank); default ``PSConfig()``.
        device: where the module computes (default: where its first parameter is). Gradients are
            copied to host memory for the push and parameters copied back after the pull.

    Example::

        model = ps.Worker(Net(), config)
        opt = ps.PushOptimizer(model)          # step() = push gradients, pull parameters
        for x, y in loader:
            opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
        model.close()                          # tells the servers this worker is done
    """

    def __init__(self, module: nn.Module, config: Optional[PSConfig] = None, device=None):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("ps.Worker: call torch.distributed.init_process_group first")
        self.config = config or PSConfig()
        self.rank, world = dist.get_rank(), dist.get_world_size()
        if self.config.is_server(self.rank, world):
            raise ValueError(f"ps.Worker: rank {self.rank} is a server (num_servers={self.config.num_servers}: "
                             f"ranks 0..{self.config.num_servers - 1} serve); run ps.serve on this rank")
        self.module = module
        self._tags = next_tags()
        named = list(module.named_parameters())
        self.plan = ShardPlan(named, self.config.num_servers, f"ps.Worker rank {self.rank}")
        self.device = torch.device(device) if device is not None else named[0][1].device
        self.servers = self.config.server_ranks(world)
        self.clock = 0
        self.closed = False
        self._pull = [torch.zeros(HEADER + n) for n in self.plan.numels]
        self._push = [torch.zeros(HEADER + n) for n in self.plan.numels]
        # CPU parameters are views of the pulled message itself; others (CUDA) are staged through
        # host memory. TDX_PS_STAGE=1 stages CPU parameters too (so CPU tests cover that path).
        on_host = self.device.type == "cpu" and os.environ.get("TDX_PS_STAGE", "0") != "1"
        self._staged = not on_host
        self._flat = self._pull if on_host else [torch.zeros(n, device=self.device) for n in self.plan.numels]
        start = HEADER if on_host else 0
        self._params, self._grad_views = [], []
        for k in self.servers:
            for view, i in zip(self.plan.views(self._flat[k], k, start), self.plan.members[k]):
                p = named[i][1]
                with torch.no_grad():
                    p.data = view  # the parameter object stays; its storage is the pulled shard
                self._params.append(p)
            self._grad_views += self.plan.views(self._push[k], k, HEADER)
        self._handshake()
        self._exchange(push=False)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def server_info(self):
        """Per server, the last reply's (updates taken, live workers, slowest worker's clock)."""
        return [tuple(int(v) for v in buf[:3].tolist()) for buf in self._pull]

    def step(self):
        """Pushes this step's gradients to every server and pulls the parameters they answer with.

        Missing gradients count as zero. Under "ssp" the answer comes once the slowest worker is
        within ``staleness`` clocks, under "sync" once every live worker pushed. Raises
        ``ServerFailedError`` naming a server that died.
        """
        if self.closed:
            raise RuntimeError(f"ps.Worker rank {self.rank}: step() after close()")
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._params]
        if not self._staged:
            torch._foreach_copy_(self._grad_views, grads)
        else:
            flat = torch.cat([g.reshape(-1) for g in grads])
            off = 0
            for k in self.servers:
                n = self.plan.numels[k]
                self._push[k][HEADER:].copy_(flat[off:off + n])  # one device-to-host copy per shard
                off += n
        self._exchange(push=True)
        self.clock += 1

    def close(self):
        """Tells every server this worker is done (idempotent). Servers stop once all workers did."""
        if self.closed:
            return
        self.closed = True
        bye = torch.tensor([float(self.clock)])
        works = [(k, dist.isend(bye, k, tag=self._tags.bye)) for k in self.servers]
        for k, work in works:
            err = wait_quietly(work)
            if err:
                raise ServerFailedError(f"ps.Worker rank {self.rank}: parameter server rank {k} failed: {err}", k)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.close()

    def _handshake(self):
        mine = describe(self.plan, self.config.code())
        keep = [post_description(mine, k, self._tags) for k in self.servers]
        for k in self.servers:
            try:
                theirs = receive_description(k, self._tags)
            except Exception as e:  # noqa: BLE001
                raise ServerFailedError(f"ps.Worker rank {self.rank}: parameter server rank {k} failed "
                                        f"before the start: {e}", k) from e
            why = explain_mismatch(mine, theirs, f"worker rank {self.rank}", f"server rank {k}", self.plan.names)
            if why:
                raise ValueError(f"ps.Worker: this worker's model does not match the servers' layout: {why}. "
                                 "Build the same module and PSConfig on every rank")
        for works, _ in keep:
            for work in works:
                wait_quietly(work)

    def _exchange(self, push):
        works = []
        for k in self.servers:
            if push:
                self._push[k][0], self._push[k][1] = self.clock, self.rank
                works.append((k, dist.isend(self._push[k], k, tag=self._tags.push)))
            works.append((k, dist.irecv(self._pull[k], k, tag=self._tags.reply)))
        for k, work in works:
            err = wait_quietly(work)
            if err:
                raise ServerFailedError(f"ps.Worker rank {self.rank}: parameter server rank {k} failed at clock "
                                        f"{self.clock}: {err}", k)
        if self._staged:
            for k in self.servers:
                self._flat[k].copy_(self._pull[k][HEADER:], non_blocking=False)


class PushOptimizer(torch.optim.Optimizer):
    """The worker's optimizer: ``step()`` is ``worker.step()`` (the servers run the real optimizer);
    ``zero_grad()`` is torch's."""

    def __init__(self, worker: Worker):
        if not isinstance(worker, Worker):
            raise TypeError(f"ps.PushOptimizer: expected a ps.Worker, got {type(worker).__name__}")
        super().__init__(worker.parameters(), {})
        self.worker = worker

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.worker.step()
        return loss
