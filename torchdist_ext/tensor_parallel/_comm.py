"""Tensor-parallel communication operators: C++ autograd functions (csrc/tensor_parallel/comm_ops.cc)
calling the c10d process group directly.

Megatron's four region operators plus the sequence-parallel pair:

* ``copy_to_region``: identity forward, all-reduce backward (input of a column-parallel GEMM).
* ``reduce_from_region``: all-reduce forward, identity backward (output of a row-parallel GEMM).
* ``gather_last_dim`` / ``scatter_last_dim``: all-gather / split along the last dim (and the reverse
  in backward).
* ``gather_seq`` / ``reduce_scatter_seq``: all-gather / reduce-scatter along the sequence dim (and
  the reverse in backward) for sequence parallelism.
"""
import torch.distributed as dist

from .. import _C

__all__ = ["copy_to_region", "reduce_from_region", "gather_last_dim", "scatter_last_dim",
           "gather_seq", "reduce_scatter_seq", "split_seq", "bytes_communicated"]

_ops = _C.tp


def _pg(group):
    return group if group is not None else dist.group.WORLD


def copy_to_region(x, group=None):
    """Identity forward; all-reduce (sum) of the gradient across ``group`` in backward."""
    return _ops.copy_to_region(x, _pg(group))


def reduce_from_region(x, group=None):
    """All-reduce (sum) across ``group`` forward; identity backward."""
    return _ops.reduce_from_region(x, _pg(group))


def gather_last_dim(x, group=None):
    """All-gather along the last dim forward; keep this rank's slice of the gradient backward."""
    return _ops.gather_dim(x, _pg(group), -1, False)


def scatter_last_dim(x, group=None):
    """Keep this rank's slice along the last dim forward; all-gather the gradient backward."""
    return _ops.scatter_dim(x, _pg(group), -1)


def gather_seq(x, group=None, dim=1, reduce_grad=True):
    """All-gather along the sequence dim ``dim``.

    Backward reduce-scatters the gradient (``reduce_grad=True``: the consumer is a column-parallel
    GEMM whose ranks each hold a partial gradient) or keeps this rank's slice (``False``: every rank
    computed the same full gradient, e.g. a replicated loss).
    """
    return _ops.gather_dim(x, _pg(group), dim, reduce_grad)


def reduce_scatter_seq(x, group=None, dim=1):
    """Reduce-scatter (sum) along the sequence dim forward; all-gather the gradient backward."""
    return _ops.reduce_scatter_dim(x, _pg(group), dim)


def split_seq(x, group=None, dim=1):
    """Keep this rank's chunk of the sequence dim forward; all-gather the gradient backward."""
    return _ops.scatter_dim(x, _pg(group), dim)


def bytes_communicated(reset=False):
    """Payload bytes these operators have handed to collectives in this process (forward and
    backward; not the cross-entropy's small reductions). ``reset``: start counting again from 0."""
    n = _ops.bytes_communicated()
    if reset:
        _ops.reset_bytes_communicated()
    return n
