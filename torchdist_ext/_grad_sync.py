"""The ``no_sync()`` switch shared by DistributedDataParallel and FullyShardedDataParallel."""
import contextlib

__all__ = ["suspended_grad_sync"]


@contextlib.contextmanager
def suspended_grad_sync(module):
    """Sets ``module.require_backward_grad_sync`` to False inside, and restores it on exit (even on error)."""
    old = module.require_backward_grad_sync
    module.require_backward_grad_sync = False
    try:
        yield
    finally:
        module.require_backward_grad_sync = old
