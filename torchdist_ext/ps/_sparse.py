"""A worker's stand-in for ``nn.Embedding(sparse=True)``: each lookup pulls only the rows it touches.

The worker keeps no copy of the table. ``forward(ids)`` asks the servers holding the table's rows for
the distinct ids of the batch, looks up into those rows, and records them so that ``Worker.step()``
pushes the gradient of those rows alone (as ``nn.Embedding(sparse=True)`` gives a sparse gradient).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = []


class SparseLookup(nn.Module):
    """Looks up rows of served table ``index`` (the plan's parameter index) of the embedding ``emb``."""

    def __init__(self, worker, index: int, emb: nn.Embedding):
        super().__init__()
        if emb.max_norm is not None:
            raise ValueError(f"ps.Worker: nn.Embedding(sparse=True, max_norm={emb.max_norm}) renormalizes its "
                             "weight in place, which the servers hold; drop max_norm or use sparse=False")
        self._worker = [worker]  # a list: not a submodule
        self.index = index
        self.num_embeddings, self.embedding_dim = emb.num_embeddings, emb.embedding_dim
        self.padding_idx, self.scale_grad_by_freq = emb.padding_idx, emb.scale_grad_by_freq
        self.requires_grad = emb.weight.requires_grad
        self.lookups = []  # (distinct ids, rows) of this step's lookups that take part in autograd

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if input.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"ps sparse embedding: expected int64 or int32 indices, got {input.dtype}")
        uniq, inverse = torch.unique(input.reshape(-1).long(), sorted=True, return_inverse=True)
        if uniq.numel() and (uniq[0] < 0 or uniq[-1] >= self.num_embeddings):
            bad = uniq[0].item() if uniq[0] < 0 else uniq[-1].item()
            raise IndexError(f"ps sparse embedding: index {bad} is out of range for a table of "
                             f"{self.num_embeddings} rows")
        rows = self._worker[0]._pull_rows(self.index, uniq.cpu())
        rows = rows.to(input.device)
        if self.requires_grad and torch.is_grad_enabled():
            rows.requires_grad_(True)
            self.lookups.append((uniq.cpu(), rows))
        pad = None
        if self.padding_idx is not None:
            hit = (uniq == self.padding_idx).nonzero()
            pad = int(hit[0, 0]) if hit.numel() else None
        return F.embedding(inverse.view(input.shape).to(input.device), rows, pad, None, 2.0,
                           self.scale_grad_by_freq, False)

    def take_gradient(self):
        """(ids, gradient rows) of the lookups since the last call (ids may repeat; the padding row dropped)."""
        got = [(ids, rows.grad) for ids, rows in self.lookups if rows.grad is not None]
        self.lookups = []
        if not got:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, self.embedding_dim)
        ids = torch.cat([g[0] for g in got])
        grads = torch.cat([g[1] for g in got]).cpu()
        if self.padding_idx is not None:
            keep = ids != self.padding_idx
            ids, grads = ids[keep], grads[keep]
        return ids, grads

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.embedding_dim}, served sparsely"
