"""Small models shared by the tensor-parallel tests and example: a Megatron MLP and a pre-LN
transformer block whose attention derives its local head count from its (possibly split) weights."""
import torch
import torch.nn.functional as F
from torch import nn

from torchdist_ext.tensor_parallel import gather_seq, split_seq


class MLP(nn.Module):
    def __init__(self, h=16, f=32):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(h, f), nn.Linear(f, h)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Attention(nn.Module):
    def __init__(self, h=16, n_heads=4):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, h // n_heads
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))

    def forward(self, x):
        b, s = x.shape[0], -1
        heads = self.q.weight.shape[0] // self.head_dim  # this rank's heads
        q, k, v = (m(x).view(b, s, heads, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, y.shape[2], heads * self.head_dim))


class Block(nn.Module):
    def __init__(self, h=16, n_heads=4, f=32):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(h), Attention(h, n_heads), nn.LayerNorm(h), MLP(h, f)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def block_plan(prefix=""):
    return {f"{prefix}attn.q": "colwise", f"{prefix}attn.k": "colwise", f"{prefix}attn.v": "colwise",
            f"{prefix}attn.o": "rowwise", f"{prefix}mlp.fc1": "colwise", f"{prefix}mlp.fc2": "rowwise",
            f"{prefix}ln1": "sequence", f"{prefix}ln2": "sequence"}


def run_sharded(model, x, group, sp):
    """Forward of a TP block/MLP on the full input ``x``; returns the full output on every rank."""
    if not sp:
        return model(x)
    return gather_seq(model(split_seq(x, group)), group, reduce_grad=False)
