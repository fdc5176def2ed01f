"""Megatron-style tensor-parallel layers whose parameters are plain tensors holding this rank's slice.

Each layer is built from the full (unsplit) module with ``from_module`` (so every TP degree starts
from the same model) or directly from sizes, in which case ``torch.nn.Linear``'s initialization of
the full weight is reproduced on every rank from the current RNG state and sliced.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ._comm import (copy_to_region, gather_last_dim, gather_seq, reduce_from_region, reduce_scatter_seq,
                    scatter_last_dim)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "mark_sequence_parallel",
           "share_input_region", "vocab_parallel_cross_entropy", "tp_degree", "check_embedding"]


def tp_degree(group=None):
    """(size, rank) of the tensor-parallel group ``group`` (None: the default group)."""
    return dist.get_world_size(group), dist.get_rank(group)


def _check_divisible(what, n, tp, op):
    if n % tp:
        raise ValueError(f"{op}: {what} = {n} is not divisible by the tensor-parallel degree {tp}; "
                         f"choose a TP degree that divides {n}")


# One dict per shared-input scope in flight (innermost last): region key -> (input, region tensor).
_scopes = []


def _enter_region(x, group, sequence_parallel, seq_dim):
    """``x`` entered into the tensor-parallel region of ``group`` (copy_to_region, or gather_seq
    under sequence parallelism), once per input tensor inside a shared-input scope."""
    key = (id(x), x._version, id(group), sequence_parallel, seq_dim, torch.is_grad_enabled())
    scope = _scopes[-1] if _scopes else None
    if scope is not None and key in scope:
        return scope[key][1]
    region = gather_seq(x, group, seq_dim, reduce_grad=True) if sequence_parallel else copy_to_region(x, group)
    if scope is not None:
        scope[key] = (x, region)  # x held: its id stays unique while the scope lives
    return region


def _open_scope(module, args):
    _scopes.append({})


def _close_scope(module, args, output):
    _scopes.pop()


def share_input_region(module):
    """Makes the column-parallel layers that ``module``'s forward calls on one input tensor (Q, K and
    V of an attention) share one entry into the region: autograd sums their input gradients before
    the single all-reduce (or reduce-scatter) of its backward, which is what Megatron's fused QKV
    layer communicates. ``parallelize_module`` applies it to every module with two or more
    column-parallel children. The scope lasts one forward of ``module``. Returns ``module``."""
    if not getattr(module, "_tdx_shared_region", False):
        module.register_forward_pre_hook(_open_scope)
        module.register_forward_hook(_close_scope, always_call=True)
        module._tdx_shared_region = True
    return module


def _setup_parallel_linear(module, op, split, in_features, out_features, bias, group, sequence_parallel, seq_dim,
                           device, dtype, full):
    """What both parallel linears share: checks that the TP degree divides the ``split`` features, sets
    the common attributes and returns ``(full nn.Linear, rank)``."""
    tp, rank = tp_degree(group)
    _check_divisible(split, in_features if split == "in_features" else out_features, tp, op)
    if full is None:
        full = nn.Linear(in_features, out_features, bias, device=device, dtype=dtype)
    module.group, module.tp = group, tp
    module.sequence_parallel, module.seq_dim = sequence_parallel, seq_dim
    module.in_features, module.out_features = in_features, out_features
    return full, rank


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with A split by rows of the output (columns of the GEMM) across ``group``.

    gather_output: all-gather the output's last dim (False: each rank keeps its output slice).
    sequence_parallel: the input is sharded along ``seq_dim``; it is all-gathered before the GEMM
        (and the gradient reduce-scattered) instead of the copy-to-region all-reduce.
    skip_bias_add: as Megatron, the bias is not added and ``forward`` returns ``(output, bias)`` (this
        rank's bias slice, matching the split output) so the caller can fuse the addition; without it
        ``forward`` returns the output alone, as ``nn.Linear`` does.
    Column-parallel layers reading one input inside a ``share_input_region`` scope (Q, K, V) share
    that one communication.
    """

    def __init__(self, in_features, out_features, bias=True, group=None, gather_output=False,
                 sequence_parallel=False, seq_dim=1, device=None, dtype=None, skip_bias_add=False, _full=None):
        super().__init__()
        if skip_bias_add and gather_output:
            raise ValueError("ColumnParallelLinear: skip_bias_add=True with gather_output=True would hand back this "
                             "rank's bias slice beside the gathered output; add the bias in the layer "
                             "(skip_bias_add=False) or keep the output split (gather_output=False)")
        full, rank = _setup_parallel_linear(self, "ColumnParallelLinear", "out_features", in_features, out_features, bias,
                                            group, sequence_parallel, seq_dim, device, dtype, _full)
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.weight = nn.Parameter(full.weight.detach().chunk(self.tp, 0)[rank].clone())
        self.bias = nn.Parameter(full.bias.detach().chunk(self.tp, 0)[rank].clone()) if full.bias is not None else None
        self._tp_dims = {"weight": 0, "bias": 0}

    @classmethod
    def from_module(cls, linear, group=None, **kwargs):
        """Slices an ``nn.Linear`` (the full weights, same on every rank) for this rank."""
        return cls(linear.in_features, linear.out_features, linear.bias is not None, group, _full=linear, **kwargs)

    def forward(self, x):
        x = _enter_region(x, self.group, self.sequence_parallel, self.seq_dim)
        if self.skip_bias_add:
            return F.linear(x, self.weight), self.bias
        y = F.linear(x, self.weight, self.bias)
        return gather_last_dim(y, self.group) if self.gather_output else y

    def extra_repr(self):
        return f"in={self.in_features}, out={self.out_features}/{self.tp}, sp={self.sequence_parallel}"


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with A split by its input columns across ``group``; the partial outputs are
    all-reduced (or reduce-scattered along ``seq_dim`` under sequence parallelism). The bias is
    replicated and added once after the reduction.

    input_is_parallel: the input is already split along its last dim (a column-parallel layer's
        output). False: the input is full; each rank keeps its slice and the input gradient is
        all-gathered back in backward (Megatron's scatter-to-region), so replicated layers before it
        get the full gradient.
    skip_bias_add: as Megatron, the bias is not added and ``forward`` returns ``(output, bias)``.
    """

    def __init__(self, in_features, out_features, bias=True, group=None, input_is_parallel=True,
                 sequence_parallel=False, seq_dim=1, device=None, dtype=None, skip_bias_add=False, _full=None):
        super().__init__()
        full, rank = _setup_parallel_linear(self, "RowParallelLinear", "in_features", in_features, out_features, bias,
                                            group, sequence_parallel, seq_dim, device, dtype, _full)
        self.rank, self.input_is_parallel, self.skip_bias_add = rank, input_is_parallel, skip_bias_add
        self.weight = nn.Parameter(full.weight.detach().chunk(self.tp, 1)[rank].clone())
        self.bias = nn.Parameter(full.bias.detach().clone()) if full.bias is not None else None
        self._tp_dims = {"weight": 1}
        if self.bias is not None and sequence_parallel:
            _sum_grad_over(self.bias, group)

    @classmethod
    def from_module(cls, linear, group=None, **kwargs):
        """Slices an ``nn.Linear`` (the full weights, same on every rank) for this rank."""
        return cls(linear.in_features, linear.out_features, linear.bias is not None, group, _full=linear, **kwargs)

    def forward(self, x):
        if not self.input_is_parallel:  # Megatron's scatter-to-region: the gradient is all-gathered back
            x = scatter_last_dim(x, self.group)
        y = F.linear(x, self.weight)
        y = reduce_scatter_seq(y, self.group, self.seq_dim) if self.sequence_parallel else reduce_from_region(y, self.group)
        if self.skip_bias_add:
            return y, self.bias
        return y + self.bias if self.bias is not None else y

    def extra_repr(self):
        return f"in={self.in_features}/{self.tp}, out={self.out_features}, sp={self.sequence_parallel}"


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` with the vocabulary rows split across ``group``: each rank looks up the ids it
    owns (zeros elsewhere) and the results are all-reduced (reduce-scattered along ``seq_dim`` under
    sequence parallelism).

    padding_idx: as ``nn.Embedding``, that row gets no gradient (on the rank that owns it).
    """

    def __init__(self, num_embeddings, embedding_dim, group=None, sequence_parallel=False, seq_dim=1,
                 device=None, dtype=None, padding_idx=None, _full=None):
        super().__init__()
        tp, rank = tp_degree(group)
        _check_divisible("num_embeddings", num_embeddings, tp, "VocabParallelEmbedding")
        if padding_idx is not None and not -num_embeddings <= padding_idx < num_embeddings:
            raise ValueError(f"VocabParallelEmbedding: padding_idx = {padding_idx} is outside the vocabulary "
                             f"[0, {num_embeddings})")
        full = _full if _full is not None else nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx,
                                                            device=device, dtype=dtype)
        self.group, self.tp, self.sequence_parallel, self.seq_dim = group, tp, sequence_parallel, seq_dim
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        per = num_embeddings // tp
        self.vocab_start, self.vocab_end = rank * per, (rank + 1) * per
        self.padding_idx = padding_idx % num_embeddings if padding_idx is not None else None
        owned = self.padding_idx is not None and self.vocab_start <= self.padding_idx < self.vocab_end
        self._local_padding_idx = self.padding_idx - self.vocab_start if owned else None
        self.weight = nn.Parameter(full.weight.detach()[self.vocab_start:self.vocab_end].clone())
        self._tp_dims = {"weight": 0}

    @classmethod
    def from_module(cls, emb, group=None, **kwargs):
        """Slices an ``nn.Embedding`` (the full table, same on every rank) for this rank."""
        check_embedding(emb, "VocabParallelEmbedding")
        return cls(emb.num_embeddings, emb.embedding_dim, group, padding_idx=emb.padding_idx, _full=emb, **kwargs)

    def forward(self, ids):
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight, self._local_padding_idx).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_seq(out, self.group, self.seq_dim)
        return reduce_from_region(out, self.group)


def check_embedding(emb, op):
    """Raises ValueError if the ``nn.Embedding`` ``emb`` uses an option the vocabulary split lacks."""
    unsupported = [n for n, on in (("max_norm", emb.max_norm is not None), ("sparse", emb.sparse),
                                   ("scale_grad_by_freq", emb.scale_grad_by_freq)) if on]
    if unsupported:
        raise ValueError(f"{op}: nn.Embedding option(s) {unsupported} are not supported with the vocabulary "
                         f"split across ranks (each needs the whole table); build the nn.Embedding without them")


def _sum_grad_over(param, group):
    """Sums ``param``'s gradient across ``group`` (a replicated parameter used on a sequence shard)."""
    def hook(g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=group)
        return g
    param.register_hook(hook)
    param._tdx_sequence_parallel = True


def mark_sequence_parallel(module, group=None):
    """Marks a replicated module (LayerNorm, dropout, ...) that runs on this rank's sequence shard:
    its parameters' gradients are summed across ``group`` so every rank holds the full gradient.
    The module is changed in place (names and state_dict keys unchanged) and returned."""
    for p in module.parameters():
        if not getattr(p, "_tdx_sequence_parallel", False):
            _sum_grad_over(p, group)
    return module


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, vocab, ignore_index):
        # logits: (N, V/tp) this rank's vocabulary slice; target: (N,) global ids.
        logits = logits.float()
        # One MAX all-reduce carries the row maxima and whether any rank saw a target outside the
        # vocabulary, so every rank raises together (none is left waiting in a collective).
        bad = ((target < 0) | (target >= vocab)) & (target != ignore_index)  # ignore_index may lie outside [0, V)
        lmax = torch.cat([logits.max(dim=-1).values, bad.any().float().view(1)])
        dist.all_reduce(lmax, op=dist.ReduceOp.MAX, group=group)
        if lmax[-1] > 0:
            where = f"target {target[bad][0].item()}" if bad.any() else "a target on another rank"
            raise IndexError(f"vocab_parallel_cross_entropy: {where} is out of bounds for a vocabulary of {vocab} "
                             f"classes (ignore_index={ignore_index})")
        lmax = lmax[:-1]
        shifted = logits - lmax.unsqueeze(-1)
        local_t = target - vocab_start
        owned = (local_t >= 0) & (local_t < logits.shape[-1])
        idx = local_t.masked_fill(~owned, 0).unsqueeze(-1)
        tgt_logit = shifted.gather(-1, idx).squeeze(-1).masked_fill(~owned, 0.0)
        exp = shifted.exp()
        sum_exp = exp.sum(-1)
        both = torch.stack([tgt_logit, sum_exp])
        dist.all_reduce(both, group=group)
        tgt_logit, sum_exp = both[0], both[1]
        loss = sum_exp.log() - tgt_logit
        valid = target != ignore_index
        loss = loss.masked_fill(~valid, 0.0)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), idx, owned & valid, valid)
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, idx, owned, valid = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, idx, -owned.to(grad.dtype).unsqueeze(-1))
        grad.mul_((g * valid).unsqueeze(-1))
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy(logits, target, group=None, ignore_index=-100, reduction="mean"):
    """Cross-entropy over vocabulary-parallel logits without gathering them.

    logits: (..., V/tp), this rank's vocabulary slice (rank r owns ids [r*V/tp, (r+1)*V/tp)).
    target: (...) global class ids. The max and the sum of exponentials are all-reduced across
    ``group`` and the target's logit comes from the rank that owns it. reduction: "mean" (over
    targets != ignore_index), "sum" or "none". A target outside [0, V) other than ``ignore_index``
    raises IndexError on every rank, as ``F.cross_entropy`` does.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} and target "
                         f"{tuple(target.shape)} differ in their leading dims")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"vocab_parallel_cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    tp, rank = tp_degree(group)
    v = logits.shape[-1]
    loss = _VocabParallelCE.apply(logits.reshape(-1, v), target.reshape(-1), group, rank * v, tp * v, ignore_index)
    loss = loss.view(target.shape).to(logits.dtype)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum().clamp(min=1)
