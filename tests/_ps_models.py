"""Models and data shared by the parameter-server tests (importable in spawned ranks)."""
import os
import signal
import sys
import time

import torch
import torch.nn as nn

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def mlp(seed=0, width=32, d_in=8, d_out=3):
    """A small MLP with the same initial values on every rank that passes the same seed."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, d_out))


def global_batches(steps, batch, seed=1, d_in=8, d_out=3):
    """``steps`` (x, y) batches of the global batch size ``batch``; workers split each in rank order."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, d_in, generator=g), torch.randint(0, d_out, (batch,), generator=g))
            for _ in range(steps)]


def digits():
    """((x_train, y_train), (x_test, y_test)) of scikit-learn's digits, 64 standardized features."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    from digits_data import load_digits_tensors

    return load_digits_tensors(flat=True)


def accuracy(model, x, y):
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item() * 100.0


class TwoTower(nn.Module):
    """A recommendation-style model: one embedding table for users and items, a linear head on the
    product of the two rows. ``sparse=True`` makes the table an ``nn.Embedding(sparse=True)``."""

    def __init__(self, rows=1000, dim=8, sparse=True, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.table = nn.Embedding(rows, dim, sparse=sparse, padding_idx=0)
        self.head = nn.Linear(dim, 1)

    def forward(self, pairs):
        e = self.table(pairs)  # [batch, 2, dim]
        return self.head(e[:, 0] * e[:, 1]).squeeze(1)


def click_batches(steps, batch, rows=1000, seed=2):
    """``steps`` (pairs, clicks) batches touching few rows of a ``rows``-row table (id 0 is padding)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, rows, (batch, 2), generator=g), torch.randint(0, 2, (batch,), generator=g).float())
            for _ in range(steps)]


class FailingSGD(torch.optim.SGD):
    """SGD that fails at its ``fail_at``-th step: its process is SIGKILLed (``how="kill"``, after
    writing the time to ``stamp`` if given) or the step raises (``how="raise"``)."""

    def __init__(self, params, fail_at, how="kill", stamp=None, **kw):
        super().__init__(params, **kw)
        self.fail_at, self.how, self.stamp, self.steps = fail_at, how, stamp, 0

    def step(self, closure=None):
        self.steps += 1
        if self.steps == self.fail_at:
            if self.how != "kill":
                raise RuntimeError("injected optimizer failure")
            if self.stamp:
                with open(self.stamp, "w") as f:
                    f.write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        return super().step(closure)
