"""Deterministic inputs and single-process reference results for collective tests.

Every rank regenerates every other rank's input from (case, rank), so each rank computes the
reference of a collective locally, in one process, and compares bit for bit.
"""
import torch
import torch.distributed as dist

FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INT_DTYPES = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]
ALL_DTYPES = FLOAT_DTYPES + INT_DTYPES + [torch.bool]

R = dist.ReduceOp
FLOAT_OPS = [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX]
INT_OPS = [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]


def ops_for(dtype):
    return FLOAT_OPS if dtype.is_floating_point else INT_OPS


def make_input(case, rank, numel, dtype, op=None):
    """Input of `rank` for test case `case` (an int): values stay small for PRODUCT."""
    g = torch.Generator().manual_seed(case * 1009 + rank * 7919 + 17)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g).bool()
    if dtype.is_floating_point:
        x = torch.randn(numel, generator=g, dtype=torch.float64)
        if op == R.PRODUCT:
            x = 0.5 + x.abs().clamp(max=1.0)
        return x.to(dtype)
    if op == R.PRODUCT:
        lo, hi = (0, 3) if dtype == torch.uint8 else (-3, 4)
    else:
        lo, hi = (0, 60) if dtype == torch.uint8 else (-100, 100)
    return torch.randint(lo, hi, (numel,), generator=g).to(dtype)


def fold(xs, op, dtype):
    """xs[0] op xs[1] op ... in rank order; fp16/bf16 accumulate in fp32 and round once."""
    if dtype == torch.bool:
        acc = xs[0].clone()
        for x in xs[1:]:
            if op in (R.SUM, R.MAX, R.BOR):
                acc = acc | x
            elif op in (R.PRODUCT, R.MIN, R.BAND):
                acc = acc & x
            else:
                acc = acc ^ x
        return acc
    acc_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    acc = xs[0].to(acc_dtype)
    for x in xs[1:]:
        x = x.to(acc_dtype)
        if op in (R.SUM, R.AVG):
            acc = acc + x
        elif op == R.PRODUCT:
            acc = acc * x
        elif op == R.MIN:
            acc = torch.minimum(acc, x)
        elif op == R.MAX:
            acc = torch.maximum(acc, x)
        elif op == R.BAND:
            acc = acc & x
        elif op == R.BOR:
            acc = acc | x
        elif op == R.BXOR:
            acc = acc ^ x
    if op == R.AVG:
        acc = acc / len(xs)
    return acc.to(dtype)


def assert_bitwise_equal(actual, expected, what):
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a = actual.contiguous().view(torch.uint8) if actual.dtype != torch.bool else actual
    e = expected.contiguous().view(torch.uint8) if expected.dtype != torch.bool else expected
    if not torch.equal(a, e):
        diff = (actual.double() - expected.double()).abs() if actual.dtype != torch.bool else (actual != expected)
        idx = int(torch.argmax(diff.float()))
        raise AssertionError(
            f"{what}: not bit-identical to the reference; first large difference at element {idx}: "
            f"{actual.flatten()[idx].item()} vs {expected.flatten()[idx].item()}"
        )


def expect_raises(exc, fragment, fn):
    """Calls fn() and checks it raises `exc` whose message contains `fragment`."""
    try:
        fn()
    except exc as e:
        assert fragment in str(e), f"expected {fragment!r} in: {e}"
        return
    raise AssertionError(f"expected {exc.__name__} containing {fragment!r}")
