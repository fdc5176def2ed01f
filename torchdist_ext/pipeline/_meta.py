"""Tensor metadata on the wire and micro-batch splitting.

A stage that does not know its input shapes learns them from a small int64 message that the
previous stage sends before its first activation of a step whose shapes are new (see ``_comm.py``): ``[count, (dtype code, ndim,
dims...) per tensor]`` padded to ``META_LEN``, or ``[-1, ...]`` when the values are more than a
tuple of tensors (then each micro-batch brings its own header, see ``_values.py``).
"""
import torch

__all__ = ["META_LEN", "encode_meta", "decode_meta", "describe", "meta_of", "split_microbatches"]

META_LEN = 64
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128]
_CODE = {d: i for i, d in enumerate(_DTYPES)}


def meta_of(tensors):
    """[(shape tuple, dtype), ...] of a sequence of tensors."""
    return [(tuple(t.shape), t.dtype) for t in tensors]


def describe(meta):
    if isinstance(meta, str):  # "object": values with a structure of their own (see _values.py)
        return "values with their own structure (not only tensors)"
    return "[" + ", ".join(f"{tuple(s)} {str(d).replace('torch.', '')}" for s, d in meta) + "]"


def encode_meta(meta, where):
    if isinstance(meta, str):  # "object": each micro-batch brings its own header
        return torch.tensor([-1] + [0] * (META_LEN - 1), dtype=torch.int64)
    vals = [len(meta)]
    for shape, dtype in meta:
        if dtype not in _CODE:
            raise TypeError(f"{where}: cannot send a tensor of dtype {dtype} between stages; supported: "
                            f"{[str(d) for d in _DTYPES]}")
        vals += [_CODE[dtype], len(shape), *shape]
    if len(vals) > META_LEN:
        raise ValueError(f"{where}: the output {describe(meta)} needs {len(vals)} metadata words, more than "
                         f"{META_LEN}; return fewer or lower-dimensional tensors, or pass input_args to the next "
                         "stage's PipelineStage")
    return torch.tensor(vals + [0] * (META_LEN - len(vals)), dtype=torch.int64)


def decode_meta(t):
    vals = t.tolist()
    if vals[0] == -1:
        return "object"
    out, i = [], 1
    for _ in range(vals[0]):
        code, ndim = vals[i], vals[i + 1]
        out.append((tuple(vals[i + 2:i + 2 + ndim]), _DTYPES[code]))
        i += 2 + ndim
    return out


def _split_one(x, n, what):
    if isinstance(x, torch.Tensor):
        if x.dim() == 0:
            raise ValueError(f"{what} is a 0-dimensional tensor, which cannot be split into {n} micro-batches "
                             "along dim 0")
        b = x.shape[0]
        if b % n:
            lo, hi = b - b % n, b + n - b % n
            raise ValueError(f"{what} has batch size {b} along dim 0, which n_microbatches={n} does not divide; use a "
                             f"batch size that is a multiple of {n} (e.g. {lo or hi} or {hi}), drop the last partial "
                             "batch (DataLoader(drop_last=True)), or change n_microbatches")
        return list(x.chunk(n, dim=0))
    return [x] * n  # non-tensors are passed to every micro-batch unchanged


def split_microbatches(args, kwargs, n, names=None):
    """Splits tensors along dim 0 into ``n`` equal micro-batches -> [(args_i, kwargs_i), ...].

    names: how errors call the positional inputs (default "positional input <i>")."""
    names = names or [f"positional input {i}" for i in range(len(args))]
    parts_a = [_split_one(a, n, f"step(): {names[i]}") for i, a in enumerate(args)]
    parts_k = {k: _split_one(v, n, f"step(): keyword input {k!r}") for k, v in kwargs.items()}
    return [(tuple(p[i] for p in parts_a), {k: p[i] for k, p in parts_k.items()}) for i in range(n)]
