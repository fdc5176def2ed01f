"""Which server holds which rows of which parameters, and the description both sides compare at start.

A parameter of at least ``PSConfig.split_bytes`` bytes (with at least one row per server) is split
by rows across every server: server j holds rows [j * R // k, (j + 1) * R // k). The other
parameters are assigned whole, largest first to the server with the fewest bytes so far (ties to
the lower server), so the shards are balanced by bytes. A server's dense pieces live in one flat
float32 buffer in module order; the pieces of a sparse embedding (``nn.Embedding(sparse=True)``)
are kept apart, since only the rows a batch touches travel.
"""
from typing import List, NamedTuple, Sequence

import torch
import torch.nn as nn

__all__ = ["Piece", "ShardPlan", "describe", "explain_mismatch", "sparse_parameter_names"]

_MAGIC = 0x7D6  # first word of a description: a message from something else never matches


class Piece(NamedTuple):
    """Rows ``rows[0]:rows[1]`` of parameter ``index`` held by ``server``; ``offset`` is the element
    offset in that server's flat dense buffer (-1 for a sparse piece)."""

    index: int
    server: int
    rows: tuple
    offset: int

    @property
    def whole(self):
        return self.rows is None


def sparse_parameter_names(module: nn.Module) -> List[str]:
    """Names of the weights of ``module``'s ``nn.Embedding(sparse=True)`` submodules."""
    return [f"{name}.weight" if name else "weight" for name, m in module.named_modules()
            if isinstance(m, nn.Embedding) and m.sparse]


class ShardPlan:
    """The assignment of a module's parameters (whole or by rows) to ``num_servers`` servers.

    Attributes:
        names, shapes: parameter names and shapes in module order.
        sparse: per parameter, whether it is served sparsely (rows on demand).
        pieces: per server, its ``Piece`` list in module order.
        numels: per server, the element count of its flat dense buffer.
    """

    def __init__(self, named_params: Sequence, num_servers: int, who: str, split_bytes=None, sparse=()):
        self.names = [n for n, _ in named_params]
        self.shapes = [tuple(p.shape) for _, p in named_params]
        bad = [f"{n} ({p.dtype})" for n, p in named_params if p.dtype != torch.float32]
        if bad:
            raise ValueError(f"{who}: the parameter server holds float32 parameters but {', '.join(bad)} "
                             "are not float32; call module.float() first")
        if not named_params:
            raise ValueError(f"{who}: the module has no parameters to serve")
        self.sparse = [n in sparse for n in self.names]
        sizes = [p.numel() for _, p in named_params]
        load = [0] * num_servers
        owner = {}
        for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
            rows = self.shapes[i][0] if self.shapes[i] else 0
            if split_bytes is not None and num_servers > 1 and sizes[i] * 4 >= split_bytes and rows >= num_servers:
                owner[i] = None
                for j in range(num_servers):
                    load[j] += sizes[i] // rows * ((j + 1) * rows // num_servers - j * rows // num_servers)
                continue
            k = min(range(num_servers), key=lambda k: (load[k], k))
            owner[i] = k
            load[k] += sizes[i]
        self.pieces: List[List[Piece]] = [[] for _ in range(num_servers)]
        self.numels = [0] * num_servers
        for i in range(len(sizes)):
            servers = range(num_servers) if owner[i] is None else [owner[i]]
            for j in servers:
                rows = None
                n = sizes[i]
                if owner[i] is None:
                    r = self.shapes[i][0]
                    rows = (j * r // num_servers, (j + 1) * r // num_servers)
                    n = sizes[i] // r * (rows[1] - rows[0])
                off = -1 if self.sparse[i] else self.numels[j]
                self.pieces[j].append(Piece(i, j, rows, off))
                if not self.sparse[i]:
                    self.numels[j] += n

    def piece_shape(self, piece: Piece):
        shape = self.shapes[piece.index]
        return shape if piece.whole else (piece.rows[1] - piece.rows[0], *shape[1:])

    def dense(self, server: int) -> List[Piece]:
        return [p for p in self.pieces[server] if p.offset >= 0]

    def sparse_pieces(self, server: int) -> List[Piece]:
        return [p for p in self.pieces[server] if p.offset < 0]

    def views(self, flat: torch.Tensor, server: int, start: int = 0) -> List[torch.Tensor]:
        """Views of ``flat[start:]`` shaped as the dense pieces of ``server``, in module order."""
        out = []
        for piece in self.dense(server):
            shape = self.piece_shape(piece)
            n = 1
            for d in shape:
                n *= d
            o = start + piece.offset
            out.append(flat[o:o + n].view(shape))
        return out


def describe(plan: ShardPlan, config_code: Sequence[int]) -> torch.Tensor:
    """An int64 tensor naming the configuration and every parameter shape, for the start handshake."""
    words = [_MAGIC, *config_code, len(plan.shapes)]
    for shape, sparse in zip(plan.shapes, plan.sparse):
        words += [len(shape) + (len(shape) + 1 if sparse else 0), *shape]
        if sparse:
            words += [-1] * (len(shape) + 1)  # a sparse embedding: the same shape, marked
    return torch.tensor(words, dtype=torch.int64)


_FIELDS = ("num_servers", "mode", "staleness", "split_bytes", "replicate")


def _parse(words):
    words = list(words)
    n_code = len(_FIELDS)
    if len(words) < n_code + 2 or words[0] != _MAGIC:
        return None, None
    code, n, pos, shapes = words[1:1 + n_code], words[1 + n_code], 2 + n_code, []
    for _ in range(n):
        nd = words[pos]
        shapes.append(tuple(words[pos + 1:pos + 1 + nd]))
        pos += 1 + nd
    return code, shapes


def _show(shape):
    if -1 in shape:
        return f"{list(shape[:(len(shape) - 1) // 2])} (sparse)"
    return str(list(shape))


def explain_mismatch(mine: torch.Tensor, theirs: torch.Tensor, me: str, them: str, names=None) -> str:
    """A sentence saying how two descriptions differ, or "" when they agree."""
    if torch.equal(mine, theirs):
        return ""
    (code_a, shapes_a), (code_b, shapes_b) = _parse(mine.tolist()), _parse(theirs.tolist())
    if code_b is None:
        return f"{them} sent no parameter-server description (is it running the same torchdist_ext.ps?)"
    if code_a != code_b:
        diff = ", ".join(f"{f} {a} vs {b}" for f, a, b in zip(_FIELDS, code_a, code_b) if a != b)
        return (f"{me} and {them} use different PSConfig values ({diff}; mode is an index into ps.MODES, "
                "split_bytes -1 is None)")
    if len(shapes_a) != len(shapes_b):
        return (f"{me}'s model has {len(shapes_a)} parameters but {them}'s has {len(shapes_b)} "
                f"(shapes {[_show(s) for s in shapes_a]} vs {[_show(s) for s in shapes_b]})")
    for i, (a, b) in enumerate(zip(shapes_a, shapes_b)):
        if a != b:
            name = f" ({names[i]})" if names else ""
            return f"parameter {i}{name} has shape {_show(a)} on {me} but {_show(b)} on {them}"
    return f"{me} and {them} describe their models differently"
