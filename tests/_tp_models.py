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


# --- Models for the rank-by-rank exactness tests ------------------------------------------------

V, H, NH, FF, B, S = 16, 16, 4, 32, 2, 8


def biased(out):
    """A Megatron ``(output, bias)`` pair added up; a plain output unchanged."""
    return out[0] + out[1] if isinstance(out, tuple) else out


class Net(nn.Module):
    """Embedding, replicated LayerNorm and Linear, two Blocks, a column-parallel layer with its output
    gathered, a replicated LayerNorm, a row-parallel layer that slices its full input, a final LayerNorm and a head
    (optionally tied to the embedding)."""

    def __init__(self, tied=False, padding_idx=None):
        super().__init__()
        self.emb = nn.Embedding(V, H, padding_idx=padding_idx)
        self.ln0, self.pre = nn.LayerNorm(H), nn.Linear(H, H)
        self.layers = nn.ModuleList(Block(H, NH, FF) for _ in range(2))
        self.mid_a, self.ln_m, self.mid_b = nn.Linear(H, FF), nn.LayerNorm(FF), nn.Linear(FF, H)
        self.ln_f, self.head = nn.LayerNorm(H), nn.Linear(H, V, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids):
        x = self.pre(self.ln0(self.emb(ids)))
        for layer in self.layers:
            x = layer(x)
        x = x + self.mid_b(self.ln_m(F.gelu(self.mid_a(x))))
        return self.head(self.ln_f(x))


class MegatronNet(nn.Module):
    """Replicated LayerNorm and Linear, then Megatron's layer pairs (their ``(output, bias)`` pairs
    added by the caller), then a replicated LayerNorm and Linear."""

    def __init__(self):
        super().__init__()
        self.ln_a, self.pre = nn.LayerNorm(H), nn.Linear(H, H)
        self.fc1, self.fc2, self.c, self.d = nn.Linear(H, FF), nn.Linear(FF, H), nn.Linear(H, FF), nn.Linear(FF, H)
        self.ln_m = nn.LayerNorm(FF)
        self.ln_b, self.out = nn.LayerNorm(H), nn.Linear(H, H)

    def forward(self, x):
        x = self.pre(self.ln_a(x))
        x = x + biased(self.fc2(F.gelu(biased(self.fc1(x)))))
        x = x + biased(self.d(self.ln_m(F.gelu(biased(self.c(x))))))
        return self.out(self.ln_b(x))


class KwargBlock(nn.Module):
    """An MLP over ``x + scale * ctx``, ``ctx`` a keyword-only tensor and ``scale`` a number."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(H, FF), nn.Linear(FF, H)

    def forward(self, x, *, ctx, scale):
        return self.fc2(F.gelu(self.fc1(x + scale * ctx)))


class SkipBlock(nn.Module):
    """A replicated Linear plus a keyword-only ``skip`` tensor."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(H, H)

    def forward(self, x, skip=None):
        return self.fc(x) + skip


class KwargNet(nn.Module):
    """Replicated Linears feeding a KwargBlock by position and keyword (``block(h, ctx=c, scale=2.0)``),
    a SkipBlock taking the block's output as the keyword ``skip``, and a replicated Linear: for the
    keyword layouts of PrepareModuleInput (Replicate() -> Shard(1) into the block, Shard(1) ->
    Replicate() into the SkipBlock)."""

    def __init__(self):
        super().__init__()
        self.inp, self.ctx = nn.Linear(H, H), nn.Linear(H, H)
        self.block, self.skip, self.out = KwargBlock(), SkipBlock(), nn.Linear(H, H)

    def forward(self, x):
        h, c = self.inp(x), self.ctx(x)
        y = self.block(h, ctx=c, scale=2.0)
        return self.out(self.skip(h, skip=y))
