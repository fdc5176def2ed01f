"""Central storage (TensorFlow's CentralStorageStrategy) as a one-server configuration."""
import torch.distributed as dist

from .config import PSConfig

__all__ = ["central_storage", "is_server"]


def central_storage(mode: str = "sync", staleness: int = 0) -> PSConfig:
    """A ``PSConfig`` with one server: rank 0 holds every parameter and the optimizer state in host
    memory; the other ranks compute, on the CPU or on a GPU each (``ps.Worker(module, config,
    device="cuda")``: parameters are pulled to the GPU, gradients pushed back to host memory).

    With ``mode="sync"`` every step applies the mean of all workers' gradients, as
    ``CentralStorageStrategy`` does; "async" and "ssp" work as with more servers.
    """
    return PSConfig(num_servers=1, mode=mode, staleness=staleness)


def is_server(config: PSConfig) -> bool:
    """Whether this rank serves under ``config`` (the first ``config.num_servers`` ranks do).

    Raises ValueError if the job leaves no rank to train.
    """
    if not dist.is_initialized():
        raise RuntimeError("ps.is_server: call torch.distributed.init_process_group first")
    return config.is_server(dist.get_rank(), dist.get_world_size())
