"""Built-in DDP communication hooks, run in C++ by torchdist_ext's reducer.

Register one on a :class:`torchdist_ext.DistributedDataParallel` before the first forward::

    from torchdist_ext import comm_hooks
    ddp.register_comm_hook(None, comm_hooks.bf16_compress)
    ddp.register_comm_hook(comm_hooks.Int8State(block=256), comm_hooks.int8_quantize)
    ddp.register_comm_hook(comm_hooks.TopKState(ratio=0.01), comm_hooks.topk_sparsify)

Python hooks written for torch's DDP (``torch.distributed.algorithms.ddp_comm_hooks``, e.g.
``default_hooks.bf16_compress_hook`` or ``powerSGD_hook.powerSGD_hook``) are registered the same
way and run unchanged: the reducer hands them torch's own ``dist.GradBucket``.

Bytes each rank sends per float32 bucket of ``n`` elements (world size ``ws``; the fp32 default is
an all_reduce of ``4n`` bytes):

============== ====================================== ==========================================
hook           sent by each rank                       how
============== ====================================== ==========================================
allreduce      ``4n``                                  all_reduce of g / ws (as torch's allreduce_hook)
fp16_compress  ``2n``                                  all_reduce of fp16(g / ws), summed in fp32
bf16_compress  ``2n``                                  all_reduce of bf16(g / ws), summed in fp32
int8_quantize  ``n + 4 * ceil(n / block)``             all_gather of int8 values + fp32 scale per block
topk_sparsify  ``12 * k``, ``k = max(1, ceil(ratio*n))`` all_gather of (int64 index, fp32 value) pairs
============== ====================================== ==========================================

With all_gather each rank also receives ``(ws - 1)`` times what one rank sends and sums the
decompressed contributions in float32, in rank order, so every rank ends with the same bits.
``int8_quantize`` and ``topk_sparsify`` keep a per-bucket residual (error feedback): they
compress ``c = g + r``, send ``compress(c)`` and keep ``r = c - decompress(compress(c))``; the
residual restarts from zero once, when the buckets are rebuilt after the first iteration.
Compression applies to float32 buckets on CPU and on CUDA (with the CUDA part built; the CUDA
kernels of ``csrc/kernels`` share the element math ``csrc/kernels/compress_math.h`` and give the
CPU's bits, top-k selects with ATen ops on CUDA); other buckets are all_reduced uncompressed.
"""
import dataclasses

__all__ = ["BuiltinHook", "Int8State", "TopKState", "allreduce", "bf16_compress", "fp16_compress",
           "int8_quantize", "topk_sparsify"]


@dataclasses.dataclass(frozen=True)
class Int8State:
    """Options of :data:`int8_quantize`.

    Attributes:
        block: elements per fp32 scale (scale = max|x| / 127 over the block).
    """

    block: int = 256

    def __post_init__(self):
        if not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"Int8State(block={self.block!r}): block must be an int >= 1 (elements per scale)")


@dataclasses.dataclass(frozen=True)
class TopKState:
    """Options of :data:`topk_sparsify`.

    Attributes:
        ratio: fraction of each bucket's elements sent per step, in (0, 1].
    """

    ratio: float = 0.01

    def __post_init__(self):
        if not (isinstance(self.ratio, (int, float)) and 0.0 < self.ratio <= 1.0):
            raise ValueError(f"TopKState(ratio={self.ratio!r}): ratio must be a number in (0, 1]")


class BuiltinHook:
    """A communication hook implemented in C++; pass it to ``register_comm_hook(state, hook)``."""

    def __init__(self, kind, state_type, doc):
        self.kind = kind
        self.state_type = state_type
        self.__doc__ = doc

    def options(self, state):
        """The C++ options for ``state`` (None: the defaults)."""
        if state is None:
            state = self.state_type() if self.state_type else None
        elif self.state_type is None or not isinstance(state, self.state_type):
            want = f"None or a {self.state_type.__name__}" if self.state_type else "None"
            raise TypeError(f"register_comm_hook(state, comm_hooks.{self.kind}): state must be {want}, "
                            f"got {type(state).__name__}")
        if isinstance(state, Int8State):
            return {"int8_block": state.block}
        if isinstance(state, TopKState):
            return {"topk_ratio": float(state.ratio)}
        return {}

    def __call__(self, state, bucket):
        raise TypeError(f"comm_hooks.{self.kind} runs inside torchdist_ext.DistributedDataParallel's C++ reducer; "
                        "register it with ddp.register_comm_hook(state, hook) instead of calling it")

    def __repr__(self):
        return f"torchdist_ext.comm_hooks.{self.kind}"


allreduce = BuiltinHook("allreduce", None, "all_reduce of the bucket divided by the world size (4n bytes).")
fp16_compress = BuiltinHook("fp16", None, "all_reduce in IEEE fp16 of the bucket divided by the world size (2n bytes).")
bf16_compress = BuiltinHook("bf16", None, "all_reduce in bfloat16 of the bucket divided by the world size (2n bytes).")
int8_quantize = BuiltinHook("int8", Int8State,
                            "int8 blockwise quantization with error feedback: all_gather of n int8 values and "
                            "ceil(n / block) fp32 scales (n + 4 * ceil(n / block) bytes); state: Int8State.")
topk_sparsify = BuiltinHook("topk", TopKState,
                            "top-k sparsification with error feedback: all_gather of k = ceil(ratio * n) "
                            "(int64 index, fp32 value) pairs (12k bytes); state: TopKState.")
