"""Parameter servers: centralized and asynchronous training over c10d point-to-point messages.

The first ``num_servers`` ranks are **servers**: each holds a shard of the parameters (assigned
whole, balanced by bytes, or split by rows from ``PSConfig.split_bytes``) and runs any
``torch.optim`` optimizer on it. The other ranks are
**workers**: an unchanged training loop around ``ps.Worker``, whose optimizer step pushes the
gradients and pulls fresh parameters. Consistency modes (``PSConfig.mode``): "sync" (the mean of
all workers' gradients per step: single-process training on the global batch), "async" (each
push applied on arrival) and "ssp" (bounded staleness ``s``). ``central_storage()`` is the
one-server configuration. A worker that dies is dropped and reported; a server that dies makes
every worker raise ``ServerFailedError`` naming it. A ``torch.optim.lr_scheduler`` on the
``PushOptimizer`` drives the servers' learning rate; ``ps.save`` / ``ps.load`` checkpoint the
servers; an ``nn.Embedding(sparse=True)`` travels only the rows a batch touches. See docs/ps.md.

    from torchdist_ext import ps

    config = ps.PSConfig(num_servers=1, mode="ssp", staleness=2)
    if ps.is_server(config):
        stats = ps.serve(Net(), torch.optim.SGD, config, lr=0.1)   # returns when the workers are done
    else:
        model = ps.Worker(Net(), config)
        opt = ps.PushOptimizer(model)
        for x, y in loader:
            opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
        model.close()
"""
from .central_storage import central_storage, is_server
from .checkpoint import load, save
from .config import MODES, PSConfig
from .server import ParameterServer, ServerStats, serve
from .worker import PushOptimizer, ServerFailedError, Worker

__all__ = ["MODES", "PSConfig", "ParameterServer", "PushOptimizer", "ServerFailedError", "ServerStats",
           "Worker", "central_storage", "is_server", "load", "save", "serve"]
