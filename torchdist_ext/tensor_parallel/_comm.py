"""Tensor-parallel communication operators as autograd functions over a c10d group.

Megatron's four region operators plus the sequence-parallel pair:

* ``copy_to_region``: identity forward, all-reduce backward (input of a column-parallel GEMM).
* ``reduce_from_region``: all-reduce forward, identity backward (output of a row-parallel GEMM).
* ``gather_last_dim`` / ``scatter_last_dim``: all-gather / split along the last dim (and the reverse
  in backward).
* ``gather_seq`` / ``reduce_scatter_seq``: all-gather / reduce-scatter along the sequence dim (and
  the reverse in backward) for sequence parallelism.
"""
import torch
import torch.distributed as dist

__all__ = ["copy_to_region", "reduce_from_region", "gather_last_dim", "scatter_last_dim",
           "gather_seq", "reduce_scatter_seq", "split_seq"]


def _size(group):
    return dist.get_world_size(group)


def _all_reduce(x, group):
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x, group, dim):
    n = _size(group)
    x = x.movedim(dim, 0).contiguous()
    out = torch.empty((n * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x, group=group)
    return out.movedim(0, dim)


def _reduce_scatter(x, group, dim):
    n = _size(group)
    if x.shape[dim] % n:
        raise ValueError(f"reduce_scatter_seq: dim {dim} of size {x.shape[dim]} is not divisible by the "
                         f"tensor-parallel degree {n}; pad the sequence to a multiple of {n}")
    x = x.movedim(dim, 0).contiguous()
    out = torch.empty((x.shape[0] // n,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x, group=group)
    return out.movedim(0, dim)


def _split(x, group, dim):
    n, r = _size(group), dist.get_rank(group)
    if x.shape[dim] % n:
        raise ValueError(f"split: dim {dim} of size {x.shape[dim]} is not divisible by the "
                         f"tensor-parallel degree {n}")
    return x.chunk(n, dim)[r].contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim, reduce_grad):
        ctx.group, ctx.dim, ctx.reduce_grad = group, dim, reduce_grad
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        if ctx.reduce_grad:
            return _reduce_scatter(g, ctx.group, ctx.dim), None, None, None
        return _split(g, ctx.group, ctx.dim), None, None, None


class _ScatterDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.group, ctx.dim), None, None


class _ReduceScatterDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.group, ctx.dim), None, None


def copy_to_region(x, group=None):
    """Identity forward; all-reduce (sum) of the gradient across ``group`` in backward."""
    return _CopyToRegion.apply(x, group)


def reduce_from_region(x, group=None):
    """All-reduce (sum) across ``group`` forward; identity backward."""
    return _ReduceFromRegion.apply(x, group)


def gather_last_dim(x, group=None):
    """All-gather along the last dim forward; keep this rank's slice of the gradient backward."""
    return _GatherDim.apply(x, group, x.dim() - 1, False)


def scatter_last_dim(x, group=None):
    """Keep this rank's slice along the last dim forward; all-gather the gradient backward."""
    return _ScatterDim.apply(x, group, x.dim() - 1)


def gather_seq(x, group=None, dim=1, reduce_grad=True):
    """All-gather along the sequence dim ``dim``.

    Backward reduce-scatters the gradient (``reduce_grad=True``: the consumer is a column-parallel
    GEMM whose ranks each hold a partial gradient) or keeps this rank's slice (``False``: every rank
    computed the same full gradient, e.g. a replicated loss).
    """
    return _GatherDim.apply(x, group, dim, reduce_grad)


def reduce_scatter_seq(x, group=None, dim=1):
    """Reduce-scatter (sum) along the sequence dim forward; all-gather the gradient backward."""
    return _ReduceScatterDim.apply(x, group, dim)


def split_seq(x, group=None, dim=1):
    """Keep this rank's chunk of the sequence dim forward; all-gather the gradient backward."""
    return _ScatterDim.apply(x, group, dim)
