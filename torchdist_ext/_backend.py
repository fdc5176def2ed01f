"""Registration of the "tdx" backend with torch.distributed."""
import torch.distributed as dist

from . import _C

BACKEND_NAME = "tdx"


def _create_tdx_backend(dist_opts, backend_opts=None):
    """Creator called by torch.distributed for every process group that uses "tdx"."""
    return _C.create_backend(
        dist_opts.store,
        dist_opts.group_rank,
        dist_opts.group_size,
        dist_opts.timeout,
        str(dist_opts.group_id),
        [int(r) for r in dist_opts.global_ranks_in_group],
    )


def is_registered() -> bool:
    """Whether "tdx" is registered with torch.distributed in this process."""
    return BACKEND_NAME in dist.Backend.backend_list


def register() -> None:
    """Registers "tdx" with torch.distributed; a second call (or import) does nothing."""
    if is_registered():
        return
    dist.Backend.register_backend(
        BACKEND_NAME, _create_tdx_backend, extended_api=True, devices=["cpu", "cuda"]
    )
