"""``ps.save`` / ``ps.load``: a checkpoint of the servers' parameters and optimizer state."""
import torch

from .worker import Worker

__all__ = ["load", "save"]


def save(worker: Worker, f) -> None:
    """Writes every server's parameters, optimizer state and update count to ``f`` (a path or file, as
    ``torch.save`` takes), from a worker between steps: ``ps.save(model, "ps.pt")``.

    The file names whole parameters, so ``ps.load`` resumes it with another worker count, server
    count or ``split_bytes``. Under "sync" it is the state after this worker's last step. The
    workers' own state (a learning-rate scheduler, the data position) is the caller's to save, as
    with ``torch.save``.
    """
    if not isinstance(worker, Worker):
        raise TypeError(f"ps.save: expected the ps.Worker whose servers to save, got {type(worker).__name__}; "
                        "call it on a worker rank between steps")
    if worker.closed:
        raise RuntimeError(f"ps.save: worker rank {worker.rank} is closed; save before Worker.close()")
    torch.save(worker.server_state_dict(), f)


def load(f, map_location=None) -> dict:
    """Reads what ``ps.save`` wrote; give it to ``ParameterServer.load_state_dict`` on every server
    before ``run()``."""
    return torch.load(f, map_location=map_location, weights_only=True)
