"""Which ranks serve, which train, and how updates are ordered (``PSConfig``)."""
import os
from dataclasses import dataclass
from typing import List, Optional

__all__ = ["PSConfig", "MODES"]

#: consistency modes: "sync" (mean of all workers' gradients per step), "async" (each push applied
#: on arrival), "ssp" (bounded staleness: a worker at clock c waits until the slowest is at c - s).
MODES = ("sync", "async", "ssp")


@dataclass
class PSConfig:
    """How a parameter-server job is laid out; every rank of the job builds the same one.

    Ranks ``0 .. num_servers - 1`` are servers, the others are workers (torchrun's ranks, so the
    roles follow from the launch command alone).
    """

    num_servers: Optional[int] = None
    """Server count k (the first k ranks serve). None reads ``$TDX_PS_SERVERS``, else 1."""
    mode: str = "sync"
    """"sync", "async" or "ssp" (see ``MODES``)."""
    staleness: int = 0
    """SSP bound s: a worker at clock c proceeds only while every live worker is at c - s or later.
    ``mode="ssp"`` with ``staleness=0`` runs as ``"sync"``."""
    split_bytes: Optional[int] = None
    """A parameter of at least this many bytes (and at least one row per server) is split by rows
    across every server (server j holds rows j*R//k to (j+1)*R//k); the others are assigned whole.
    None (the default) assigns every parameter whole."""

    replicate: Optional[bool] = None
    """Keep a replica of every server's shard on another server (another host when the servers span
    hosts): each push is applied on both copies before the worker goes on, and when a server dies
    its workers switch that shard to the replica with no acknowledged update lost. Needs
    ``num_servers >= 2``. None reads ``$TDX_PS_REPLICATE`` (1 or 0), else False."""

    def __post_init__(self):
        if self.num_servers is None:
            env = os.environ.get("TDX_PS_SERVERS", "1")
            try:
                self.num_servers = int(env)
            except ValueError:
                raise ValueError(f"PSConfig: $TDX_PS_SERVERS={env!r} is not an integer server count") from None
        if self.replicate is None:
            env = os.environ.get("TDX_PS_REPLICATE", "0")
            if env not in ("0", "1"):
                raise ValueError(f"PSConfig: $TDX_PS_REPLICATE={env!r} must be 1 (keep a replica of every "
                                 "server's shard) or 0")
            self.replicate = env == "1"
        if self.mode not in MODES:
            raise ValueError(f"PSConfig: mode={self.mode!r} is not one of {', '.join(MODES)}")
        if not isinstance(self.staleness, int) or self.staleness < 0:
            raise ValueError(f"PSConfig: staleness={self.staleness!r} must be an integer >= 0 (the SSP bound s)")
        if self.mode != "ssp" and self.staleness:
            raise ValueError(f"PSConfig: staleness={self.staleness} applies to mode='ssp' only, not mode={self.mode!r}")
        if self.split_bytes is not None and (not isinstance(self.split_bytes, int) or self.split_bytes < 1):
            raise ValueError(f"PSConfig: split_bytes={self.split_bytes!r} must be None or an integer >= 1 (the "
                             "size from which a parameter is split by rows across the servers)")
        if self.num_servers < 1:
            raise ValueError(f"PSConfig: num_servers={self.num_servers} but a parameter-server job needs at least "
                             "one server (the first num_servers ranks serve; set num_servers or $TDX_PS_SERVERS >= 1)")
        if self.replicate and self.num_servers < 2:
            raise ValueError(f"PSConfig: replicate=True keeps each shard's replica on another server, but "
                             f"num_servers={self.num_servers}; use num_servers >= 2 or replicate=False")

    @property
    def effective_mode(self):
        """The mode that runs: "ssp" with staleness 0 is "sync"."""
        return "sync" if self.mode == "ssp" and self.staleness == 0 else self.mode

    def server_ranks(self, world_size) -> List[int]:
        """Ranks that serve in a job of ``world_size`` ranks; raises ValueError if none are left to train."""
        self.check_world(world_size)
        return list(range(self.num_servers))

    def worker_ranks(self, world_size) -> List[int]:
        """Ranks that train in a job of ``world_size`` ranks."""
        self.check_world(world_size)
        return list(range(self.num_servers, world_size))

    def is_server(self, rank, world_size) -> bool:
        """Whether ``rank`` serves."""
        self.check_world(world_size)
        return rank < self.num_servers

    def check_world(self, world_size):
        """Raises ValueError unless ``world_size`` leaves at least one worker beside the servers."""
        if world_size <= self.num_servers:
            raise ValueError(f"PSConfig: num_servers={self.num_servers} but the job has world_size={world_size} "
                             "ranks, so every rank would serve and none would train; use fewer servers or more "
                             "ranks (world_size >= num_servers + 1)")

    def code(self):
        """(num_servers, mode index, staleness, split_bytes or -1, replicate): compared between workers
        and servers at start."""
        return [self.num_servers, MODES.index(self.mode), self.staleness,
                -1 if self.split_bytes is None else self.split_bytes, int(self.replicate)]
