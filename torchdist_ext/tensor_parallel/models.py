"""A reference pre-LN transformer block for tensor parallelism (used by the example and benchmark)."""
import torch.nn.functional as F
from torch import nn

__all__ = ["Block", "block_plan"]


class Block(nn.Module):
    """Pre-LN transformer block with causal attention and a 4x GELU MLP. Attention reads its local
    head count from the projections' outputs, so the same code runs unsplit, under our
    ``parallelize_module`` and under torch's DTensor TP (which hands back local tensors)."""

    def __init__(self, h, n_heads):
        super().__init__()
        if h % n_heads:
            raise ValueError(f"Block: hidden size {h} is not divisible by n_heads {n_heads}")
        self.n_heads, self.head_dim = n_heads, h // n_heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, _ = x.shape
        y = self.ln1(x)
        q, k, v = (m(y) for m in (self.q, self.k, self.v))
        heads = q.shape[-1] // self.head_dim
        q, k, v = (t.view(b, s, heads, self.head_dim).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
        x = x + self.o(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def block_plan(prefix="", col="colwise", row="rowwise"):
    """The Megatron plan for a ``Block`` named ``prefix`` (e.g. "blocks.0."): Q, K, V, fc1 by columns,
    O, fc2 by rows. ``col`` / ``row``: a style or a zero-argument factory of one (torch's classes)."""
    make = lambda s: s() if callable(s) else s  # noqa: E731
    return {f"{prefix}{n}": make(col) if n in ("q", "k", "v", "fc1") else make(row)
            for n in ("q", "k", "v", "o", "fc1", "fc2")}
