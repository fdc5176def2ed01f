"""Python side of the direct ops ``torch.ops.tdx.*`` (csrc/backend/direct_ops.cc).

Two things only the package can give them, both installed on import:

- how ``group_name=""`` finds torch.distributed's current default group (``dist.group.WORLD``,
  which ``dist.shrink_group`` replaces by a group of another name); named groups are resolved by
  torch's group registry in C++, as torch's functional collectives resolve them;
- fake kernels (``torch.library.register_fake``), so ``torch.compile`` traces the ops: each
  returns its first argument, which it writes in place, with that argument's shape and dtype.
"""
import torch
import torch.distributed as dist

from . import _C

_OPS = ("all_reduce_", "all_gather_into_tensor_", "reduce_scatter_tensor_")
_installed = False


def _default_group_name():
    """The group_name of torch.distributed's default group, or None when there is none."""
    world = dist.group.WORLD
    return None if world is None else world.group_name


def _fake_all_reduce(tensor, op="sum", group_name=""):
    return tensor


def _fake_all_gather_into_tensor(output, input, group_name=""):  # noqa: A002 - the op's own argument name
    return output


def _fake_reduce_scatter_tensor(output, input, op="sum", group_name=""):  # noqa: A002
    return output


def install():
    """Registers the default-group lookup and the fake kernels; a second call does nothing."""
    global _installed
    if _installed:
        return
    _installed = True
    _C.set_default_group_name(_default_group_name)
    fakes = (_fake_all_reduce, _fake_all_gather_into_tensor, _fake_reduce_scatter_tensor)
    for name, fake in zip(_OPS, fakes):
        torch.library.register_fake(f"tdx::{name}", fake)
