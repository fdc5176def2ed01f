"""Values between stages that are not a tuple of tensors: dicts, nested containers, Python values.

A stage's output is passed to the next stage's forward as positional arguments (a tuple or list is
unpacked, anything else is one argument), as torch.distributed.pipelining does. A tuple of tensors
travels as before (shapes once per step). Anything else is a :class:`Packet`: its structure
(``torch.utils._pytree``), its non-tensor leaves and its tensors' shapes travel per micro-batch as a
small pickled header (a length, then the bytes), then its tensors. Gradients flow back for the
floating-point tensors among the leaves, in flattening order.
"""
import pickle

import torch
from torch.utils import _pytree as pytree

from ._meta import meta_of

__all__ = ["OBJECT", "Packet", "decode_header", "float_leaves", "needs_packet", "rebuild", "tensor_leaves"]

OBJECT = "object"
"""Input meta of a stage that receives packets (structure and shapes per micro-batch)."""


def tensor_leaves(value):
    """The tensors inside ``value`` (any nesting of tuples, lists, dicts), in flattening order."""
    return [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]


def float_leaves(value):
    return [x for x in tensor_leaves(value) if x.is_floating_point()]


def needs_packet(outs):
    """Whether the positional outputs ``outs`` (a tuple) are more than a tuple of tensors."""
    return not all(isinstance(o, torch.Tensor) for o in outs)


class Packet:
    """One micro-batch's output of a stage: its structure, its leaves (tensors and Python values)."""

    __slots__ = ("spec", "leaves")

    def __init__(self, outs):
        self.leaves, self.spec = pytree.tree_flatten(outs)

    @property
    def tensors(self):
        return [x for x in self.leaves if isinstance(x, torch.Tensor)]

    def header(self, where):
        """(int64 length tensor, uint8 bytes tensor) describing everything but the tensors' data."""
        values = [(True, None) if isinstance(x, torch.Tensor) else (False, x) for x in self.leaves]
        try:
            blob = pickle.dumps((self.spec, values, meta_of(self.tensors)))
        except Exception as err:
            raise TypeError(f"{where}: the output's non-tensor values cannot be pickled to send them to the next "
                            f"stage ({err}); return tensors, numbers, strings or containers of them") from err
        data = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        return torch.tensor([len(blob)], dtype=torch.int64), data

    def args(self, tensors):
        """The next stage's positional arguments, with ``tensors`` in place of this packet's tensors."""
        it = iter(tensors)
        leaves = [next(it) if isinstance(x, torch.Tensor) else x for x in self.leaves]
        return tuple(pytree.tree_unflatten(leaves, self.spec))


def decode_header(data):
    """-> (spec, [(is a tensor, value), ...] per leaf, tensor meta)."""
    return pickle.loads(data.numpy().tobytes())


def rebuild(spec, slots, tensors):
    """The positional arguments a packet described, with the received ``tensors`` in their places."""
    it = iter(tensors)
    leaves = [next(it) if is_tensor else v for is_tensor, v in slots]
    return tuple(pytree.tree_unflatten(leaves, spec))
