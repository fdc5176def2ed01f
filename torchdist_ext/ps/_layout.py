"""Which server holds which parameters, and the description both sides compare at start.

Parameters are assigned whole to servers, largest first to the server with the fewest bytes so
far (ties to the lower server), so the shards are balanced by bytes. A shard is one flat float32
buffer holding its parameters in module order.
"""
from typing import List, Sequence

import torch

__all__ = ["ShardPlan", "describe", "explain_mismatch"]

_MAGIC = 0x7D5  # first word of a description: a message from something else never matches


class ShardPlan:
    """The assignment of a module's parameters to ``num_servers`` flat float32 shards.

    Attributes:
        names: parameter names in module order.
        shapes: their shapes.
        owner: server index (0 .. num_servers - 1) of each parameter.
        members: per server, the parameter indices it holds, in module order.
        offsets: per parameter, its element offset inside its server's flat shard.
        numels: per server, the shard's element count.
    """

    def __init__(self, named_params: Sequence, num_servers: int, who: str):
        self.names = [n for n, _ in named_params]
        self.shapes = [tuple(p.shape) for _, p in named_params]
        bad = [f"{n} ({p.dtype})" for n, p in named_params if p.dtype != torch.float32]
        if bad:
            raise ValueError(f"{who}: the parameter server holds float32 parameters but {', '.join(bad)} "
                             "are not float32; call module.float() first")
        if not named_params:
            raise ValueError(f"{who}: the module has no parameters to serve")
        sizes = [p.numel() for _, p in named_params]
        load = [0] * num_servers
        self.owner = [0] * len(sizes)
        for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
            k = min(range(num_servers), key=lambda k: (load[k], k))
            self.owner[i] = k
            load[k] += sizes[i]
        self.members: List[List[int]] = [[i for i in range(len(sizes)) if self.owner[i] == k]
                                         for k in range(num_servers)]
        self.offsets = [0] * len(sizes)
        self.numels = []
        for idx in self.members:
            off = 0
            for i in idx:
                self.offsets[i] = off
                off += sizes[i]
            self.numels.append(off)

    def views(self, flat: torch.Tensor, server: int, start: int = 0) -> List[torch.Tensor]:
        """Views of ``flat[start:]`` shaped as the parameters of ``server``, in module order."""
        out = []
        for i in self.members[server]:
            n = 1
            for d in self.shapes[i]:
                n *= d
            o = start + self.offsets[i]
            out.append(flat[o:o + n].view(self.shapes[i]))
        return out


def describe(plan: ShardPlan, config_code: Sequence[int]) -> torch.Tensor:
    """An int64 tensor naming the configuration and every parameter shape, for the start handshake."""
    words = [_MAGIC, *config_code, len(plan.shapes)]
    for shape in plan.shapes:
        words += [len(shape), *shape]
    return torch.tensor(words, dtype=torch.int64)


def _parse(words):
    words = list(words)
    if len(words) < 5 or words[0] != _MAGIC:
        return None, None
    code, n, pos, shapes = words[1:4], words[4], 5, []
    for _ in range(n):
        nd = words[pos]
        shapes.append(tuple(words[pos + 1:pos + 1 + nd]))
        pos += 1 + nd
    return code, shapes


def explain_mismatch(mine: torch.Tensor, theirs: torch.Tensor, me: str, them: str, names=None) -> str:
    """A sentence saying how two descriptions differ, or "" when they agree."""
    if torch.equal(mine, theirs):
        return ""
    (code_a, shapes_a), (code_b, shapes_b) = _parse(mine.tolist()), _parse(theirs.tolist())
    if code_b is None:
        return f"{them} sent no parameter-server description (is it running torchdist_ext.ps?)"
    if code_a != code_b:
        fields = ("num_servers", "mode", "staleness")
        diff = ", ".join(f"{f} {a} vs {b}" for f, a, b in zip(fields, code_a, code_b) if a != b)
        return f"{me} and {them} use different PSConfig values ({diff}; mode is an index into ps.MODES)"
    if len(shapes_a) != len(shapes_b):
        return (f"{me}'s model has {len(shapes_a)} parameters but {them}'s has {len(shapes_b)} "
                f"(shapes {shapes_a} vs {shapes_b})")
    for i, (a, b) in enumerate(zip(shapes_a, shapes_b)):
        if a != b:
            name = f" ({names[i]})" if names else ""
            return f"parameter {i}{name} has shape {list(a)} on {me} but {list(b)} on {them}"
    return f"{me} and {them} describe their models differently"
