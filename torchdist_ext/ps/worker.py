"""The worker role: an unchanged training loop whose optimizer step pushes gradients and pulls."""
import io
import os
import warnings
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from ._layout import ShardPlan, describe, explain_mismatch, sparse_parameter_names
from ._protocol import (FAILED, HEADER, LIVE, PULL, PUSH, ROWS, SLOWEST, STATE, STATUS, UPDATES, control, counters,
                        lr_word, next_tags, post_description, receive_description, replica_tags, wait_quietly)
from ._replicas import job_holders
from ._sparse import SparseLookup
from ._state import merge
from .config import PSConfig

__all__ = ["Worker", "PushOptimizer", "ServerFailedError"]


class ServerFailedError(RuntimeError):
    """A parameter server a worker depends on died or stopped answering (with ``replicate``: and the
    replica of its shard too); ``server_rank`` names it."""

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

    With ``PSConfig(replicate=True)`` each push goes to the server of each shard and to the server
    holding that shard's replica, and ``step()`` returns once both applied it (the replica answers
    with a header only). If a server dies (its process exits, or its loop raises), the worker warns,
    pulls that shard from its replica and goes on with the replica as the shard's server; a lost
    replica is dropped with a warning. ``acked`` counts, per shard, the pushes acknowledged by the
    copy that now serves it; ``failovers`` lists (shard, lost server, new server, clock).
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
        bags = [n for n, m in module.named_modules() if isinstance(m, nn.EmbeddingBag) and m.sparse]
        if bags:
            raise ValueError(f"ps.Worker: {', '.join(bags)} are nn.EmbeddingBag(sparse=True); the parameter server "
                             "serves nn.Embedding(sparse=True) sparsely (rows on demand) but not EmbeddingBag: use "
                             "nn.Embedding(sparse=True) and reduce the bag in forward, or sparse=False")
        self._tags = next_tags()
        named = list(module.named_parameters())
        sparse = sparse_parameter_names(module)
        self.plan = ShardPlan(named, self.config.num_servers, f"ps.Worker rank {self.rank}",
                              self.config.split_bytes, sparse)
        self.device = torch.device(device) if device is not None else named[0][1].device
        self.servers = self.config.server_ranks(world)
        # per shard (its server's rank): the copy that answers in full, and the replica that acknowledges
        self._owner = {k: (k, self._tags) for k in self.servers}
        self._backup = {k: None for k in self.servers}
        if self.config.replicate:
            holders = job_holders(self.config.num_servers)
            self._backup = {k: (holders[k], replica_tags(self._tags)) for k in self.servers}
        self._ack = {k: torch.zeros(HEADER) for k in self.servers}
        self.acked = {k: 0 for k in self.servers}
        self.failovers = []
        self.clock = 0
        self.closed = False
        self.lr = 0.0
        self.traffic = {"sent": 0, "received": 0}
        self._tables = {}
        for name in sparse:  # nn.Embedding(sparse=True): replaced by a lookup that pulls rows on demand
            path = name.rsplit(".", 1)[0] if "." in name else ""
            lookup = SparseLookup(self, self.plan.names.index(name), module.get_submodule(path))
            if path:
                parent, _, attr = path.rpartition(".")
                setattr(module.get_submodule(parent), attr, lookup)
            else:
                module = lookup
            self._tables[lookup.index] = lookup
        self.module = module
        numels = self.plan.numels
        self._pull = [torch.zeros(HEADER + n) for n in numels]
        self._push = [torch.zeros(n) for n in numels]
        # CPU parameters are views of the pulled message itself; others (CUDA) are staged through
        # host memory. TDX_PS_STAGE=1 stages CPU parameters too (so CPU tests cover that path).
        # A parameter split by rows across servers keeps its own storage: its rows are copied in.
        on_host = self.device.type == "cpu" and os.environ.get("TDX_PS_STAGE", "0") != "1"
        self._staged = not on_host
        self._flat = self._pull if on_host else [torch.zeros(n, device=self.device) for n in numels]
        start = HEADER if on_host else 0
        self._grad_pieces, self._grad_views, self._rows_in, self._rows_from = [], [], [], []
        for k in self.servers:
            for piece, view, grad_view in zip(self.plan.dense(k), self.plan.views(self._flat[k], k, start),
                                              self.plan.views(self._push[k], k)):
                p = named[piece.index][1]
                if piece.whole:
                    with torch.no_grad():
                        p.data = view  # the parameter object stays; its storage is the pulled shard
                else:
                    self._rows_in.append(p.data[piece.rows[0]:piece.rows[1]])
                    self._rows_from.append(view)
                self._grad_pieces.append((p, piece))
                self._grad_views.append(grad_view)
        self._handshake()
        self._exchange(push=False)
        lrs = {k: lr_word(self._pull[k]).item() for k in self.servers}
        if len(set(lrs.values())) > 1:
            raise ValueError(f"ps.Worker: the servers run different learning rates {lrs} (server rank: lr); "
                             "build every server with the same optimizer arguments")
        self.lr = lrs[self.servers[0]]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def server_info(self):
        """Per server (shard), the last full reply's (updates taken, live workers, slowest worker's clock)."""
        return [tuple(int(counters(buf)[i]) for i in (UPDATES, LIVE, SLOWEST)) for buf in self._pull]

    def step(self):
        """Pushes this step's gradients to every server and pulls the parameters they answer with.

        Missing gradients count as zero; a sparse embedding pushes the rows its lookups since the
        last step touched. The servers apply the push with learning rate ``self.lr`` (what
        ``PushOptimizer``'s param group holds, so a ``torch.optim.lr_scheduler`` on it drives the
        servers). Under "ssp" the answer comes once the slowest worker is within ``staleness``
        clocks, under "sync" once every live worker pushed. Raises ``ServerFailedError`` naming a
        server that died.
        """
        if self.closed:
            raise RuntimeError(f"ps.Worker rank {self.rank}: step() after close()")
        grads = []
        for p, piece in self._grad_pieces:
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            grads.append(g if piece.whole else g[piece.rows[0]:piece.rows[1]])
        if not self._staged:
            if grads:
                torch._foreach_copy_(self._grad_views, grads)
        elif grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            off = 0
            for k in self.servers:
                n = self.plan.numels[k]
                self._push[k].copy_(flat[off:off + n])  # one device-to-host copy per shard
                off += n
        self._exchange(push=True)
        self.clock += 1

    def server_state_dict(self) -> dict:
        """Every server's parameters, optimizer state and update count, merged into one dict keyed by
        parameter name (what ``ps.save`` writes). Call it between steps; under "sync" it is the state
        after this worker's last step on every server."""
        parts = []
        for k in self.servers:
            parts.append(self._with_failover(k, "sending its state", self._state_of))
        return merge(parts)

    def _state_of(self, k, rank, tags):
        length = torch.zeros(1, dtype=torch.int64)
        err = self._settle([(k, _post(dist.isend, control(STATE, self.rank, self.clock), rank, tags.control)),
                            (k, _post(dist.irecv, length, rank, tags.state))])
        if err:
            return None, err
        data = torch.empty(int(length.item()), dtype=torch.uint8)
        err = self._settle([(k, _post(dist.irecv, data, rank, tags.state))])
        return (None, err) if err else (torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True), "")

    def close(self):
        """Tells every server this worker is done (idempotent). Servers stop once all workers did."""
        if self.closed:
            return
        self.closed = True
        bye = torch.tensor([float(self.clock)])
        works = {k: [(rank, _post(dist.isend, bye, rank, tags.bye)) for rank, tags in self._copies(k)]
                 for k in self.servers}
        for k, sent in works.items():
            errs = [(rank, wait_quietly(work)) for rank, work in sent]
            if all(err for _, err in errs):  # every copy of the shard is gone (a lost replica alone is not)
                rank, err = errs[0]
                raise ServerFailedError(f"ps.Worker rank {self.rank}: parameter server rank {rank} failed: {err}",
                                        rank)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.close()

    def _copies(self, k):
        """(rank, tags) of shard ``k``'s live copies: the one that answers in full first."""
        return [c for c in (self._owner[k], self._backup[k]) if c is not None]

    def _handshake(self):
        mine = describe(self.plan, self.config.code())
        # in the servers' order (each server handshakes its own shard, then the replica it holds): between
        # hosts a pair's messages arrive in order, so a description the server does not expect yet
        # would hold back the ones it waits for
        copies = sorted((c for k in self.servers for c in self._copies(k)), key=lambda c: (c[0], c[1] != self._tags))
        keep = [post_description(mine, rank, tags) for rank, tags in copies]
        for k, tags in copies:
            try:
                theirs = receive_description(k, tags)
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

    def _send(self, key, rank, tensor, tag):
        self.traffic["sent"] += tensor.numel() * tensor.element_size()
        return key, _post(dist.isend, tensor, rank, tag)

    def _recv(self, key, rank, tensor, tag):
        self.traffic["received"] += tensor.numel() * tensor.element_size()
        return key, _post(dist.irecv, tensor, rank, tag)

    @staticmethod
    def _settle(works):
        """Waits for every work; returns the first error's text, or ""."""
        errs = [wait_quietly(work) for _, work in works]
        return next((e for e in errs if e), "")

    def _lost(self, k, rank, err, doing):
        """Shard ``k``'s copy on ``rank`` failed: switch to (or drop) the replica; raise when none is left."""
        if self._backup[k] is not None and self._backup[k][0] == rank:
            self._backup[k] = None
            warnings.warn(f"ps.Worker rank {self.rank}: server rank {rank}, which held the replica of shard {k}, "
                          f"failed at clock {self.clock}; shard {k} goes on without a replica: {err}",
                          RuntimeWarning, stacklevel=3)
            return
        if self._backup[k] is None:
            raise ServerFailedError(f"ps.Worker rank {self.rank}: parameter server rank {rank} failed at clock "
                                    f"{self.clock} while {doing}: {err}", rank)
        self._owner[k], self._backup[k] = self._backup[k], None
        self.failovers.append((k, rank, self._owner[k][0], self.clock))
        warnings.warn(f"ps.Worker rank {self.rank}: parameter server rank {rank} failed at clock {self.clock} while "
                      f"{doing}; shard {k} goes on on its replica on server rank {self._owner[k][0]}: {err}",
                      RuntimeWarning, stacklevel=3)

    def _with_failover(self, k, doing, request):
        """``request(k, rank, tags) -> (result, error text)`` on shard ``k``'s serving copy, again on the
        replica if that copy failed (for requests that change nothing on the server)."""
        while True:
            rank, tags = self._owner[k]
            result, err = request(k, rank, tags)
            if not err:
                return result
            self._lost(k, rank, err, doing)

    def _sparse_push(self, k):
        """The int64 [counts..., ids...] and float32 rows of server ``k``'s sparse pieces (None: it has none)."""
        pieces = self.plan.sparse_pieces(k)
        if not pieces:
            return None, None
        counts, ids, rows = [], [], []
        for piece in pieces:
            got_ids, got_rows = self._taken[piece.index]
            if not piece.whole:
                keep = (got_ids >= piece.rows[0]) & (got_ids < piece.rows[1])
                got_ids, got_rows = got_ids[keep] - piece.rows[0], got_rows[keep]
            counts.append(got_ids.numel())
            ids.append(got_ids)
            rows.append(got_rows.reshape(-1))
        return torch.cat([torch.tensor(counts, dtype=torch.int64), *ids]), torch.cat(rows)

    def _exchange(self, push):
        """Sends each shard's copies this step's PUSH (or, at start, nothing) and takes their replies:
        the full one into the pulled buffer, a replica's header into its acknowledgement buffer."""
        works = []
        if push:
            self._taken = {i: t.take_gradient() for i, t in self._tables.items()}
        for k in self.servers:
            if push:
                ids, rows = self._sparse_push(k)
                words = 0 if ids is None else ids.numel()
            for i, (rank, tags) in enumerate(self._copies(k)):
                key = (k, rank)
                if push:
                    works.append(self._send(key, rank, control(PUSH, self.rank, self.clock, self.lr, words, full=int(i == 0)),
                                            tags.control))
                    if self._push[k].numel():
                        works.append(self._send(key, rank, self._push[k], tags.grads))
                    if ids is not None:
                        works.append(self._send(key, rank, ids, tags.ids))
                        if rows.numel():
                            works.append(self._send(key, rank, rows, tags.rows))
                works.append(self._recv(key, rank, self._pull[k] if i == 0 else self._ack[k], tags.reply))
        failed = {}
        for key, work in works:
            err = wait_quietly(work)
            if err and key not in failed:
                failed[key] = err
        for k in self.servers:
            for i, (rank, _) in enumerate(self._copies(k)):
                buf = self._pull[k] if i == 0 else self._ack[k]
                if (k, rank) not in failed and int(counters(buf)[STATUS]) == FAILED:
                    failed[(k, rank)] = "its serving loop raised an exception (see that rank's error)"
        doing = "pushing" if push else "sending the initial parameters"
        for (k, rank), err in sorted(failed.items(), key=lambda kv: self._copies(kv[0][0])[0][0] != kv[0][1]):
            pulled = self._owner[k][0] == rank
            self._lost(k, rank, err, doing)
            if pulled:  # the replica acknowledged this step: pull the shard from it in full
                self._with_failover(k, doing, self._pull_shard)
        if push:
            for k in self.servers:
                self.acked[k] += 1
        if self._staged:
            for k in self.servers:
                self._flat[k].copy_(self._pull[k][HEADER:], non_blocking=False)
        if self._rows_in:
            torch._foreach_copy_(self._rows_in, self._rows_from)

    def _pull_shard(self, k, rank, tags):
        works = [self._send(k, rank, control(PULL, self.rank, self.clock, self.lr), tags.control),
                 self._recv(k, rank, self._pull[k], tags.reply)]
        err = self._settle(works)
        if not err and int(counters(self._pull[k])[STATUS]) == FAILED:
            err = "its serving loop raised an exception (see that rank's error)"
        return None, err

    def _pull_rows(self, index, uniq):
        """Rows ``uniq`` (sorted distinct ids) of sparse parameter ``index``, pulled from their servers."""
        if self.closed:
            raise RuntimeError(f"ps.Worker rank {self.rank}: a lookup in {self.plan.names[index]} after close() "
                               "(the servers hold the table; look up before closing)")
        out = []
        n_rows, dim = self.plan.shapes[index][0], self.plan.shapes[index][1:]
        for k in self.servers:
            piece = next((pc for pc in self.plan.sparse_pieces(k) if pc.index == index), None)
            if piece is None:
                continue
            lo, hi = piece.rows if not piece.whole else (0, n_rows)
            a, b = torch.searchsorted(uniq, torch.tensor([lo, hi])).tolist()
            if a == b:
                continue
            ids = uniq[a:b] - lo

            def request(k, rank, tags, ids=ids):
                rows = torch.empty(ids.numel(), *dim)
                err = self._settle([
                    self._send(k, rank, control(ROWS, self.rank, self.clock, self.lr, ids.numel(), index), tags.control),
                    self._send(k, rank, ids, tags.ids), self._recv(k, rank, rows, tags.rows)])
                return rows, err

            out.append(self._with_failover(k, f"sending rows of {self.plan.names[index]}", request))
        return torch.cat(out) if out else torch.empty(0, *dim)


class _Failed:
    """A send or receive that failed as it was posted (between hosts, Gloo raises at once on a
    connection its peer closed): its ``wait()`` raises that error, as a failed Work's would."""

    def __init__(self, error):
        self.error = error

    def wait(self):
        raise self.error


def _post(op, tensor, rank, tag):
    try:
        return op(tensor, rank, tag=tag)
    except Exception as e:  # noqa: BLE001 - reported by the wait, with the server's rank
        return _Failed(e)


class PushOptimizer(torch.optim.Optimizer):
    """The worker's optimizer: ``step()`` is ``worker.step()`` (the servers run the real optimizer);
    ``zero_grad()`` is torch's.

    Its one param group's ``lr`` starts at the servers' learning rate and travels with every push,
    so a ``torch.optim.lr_scheduler`` built on it schedules the servers' optimizers::

        opt = ps.PushOptimizer(model)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=30, gamma=0.1)
        for x, y in loader:
            opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step(); sched.step()

    Only the learning rate travels: a scheduler that changes other hyperparameters (OneCycleLR's
    momentum) raises, as torch's schedulers do for an optimizer without them.
    """

    def __init__(self, worker: Worker):
        if not isinstance(worker, Worker):
            raise TypeError(f"ps.PushOptimizer: expected a ps.Worker, got {type(worker).__name__}")
        super().__init__(worker.parameters(), {"lr": worker.lr})
        self.worker = worker

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.worker.lr = float(self.param_groups[0]["lr"])
        self.worker.step()
        return loss
