"""tdx's flight recorder: what every rank's recent collectives were, for finding a hang or a desync.

torch's flight recorder keeps the last calls of its gloo and NCCL groups in a ring buffer inside
libtorch, which an extension cannot reach; tdx keeps its own of the same layout. Turn it on with
torch's variable, before the first tdx group is made::

    TORCH_FR_BUFFER_SIZE=2000 torchrun --nproc-per-node 4 train.py

(tdx records only when it is set: gloo records by default, but a record captures the caller's
Python stack, which costs more than a small tdx call.) Then:

- ``torchdist_ext.fr_trace.dump_fr_trace()`` / ``dump_fr_trace_json()``: the buffer, as torch's
  ``torch._C._distributed_c10d._dump_fr_trace()`` / ``_dump_fr_trace_json()`` give theirs (the same
  keys: ``version``, ``pg_config``, ``pg_status``, ``entries``; one entry per tdx call with its
  group, sequence number, sizes, dtypes, state and the caller's stack);
- a call that fails for the group (a timeout, a rank gone) writes the buffer once per process to
  ``$TORCH_FR_DUMP_TEMP_FILE<global rank>`` (torch's default ``~/.cache/torch/comm_lib_trace_rank_<rank>``),
  as NCCL does on a timeout; ``dump_fr_trace_to_file()`` writes it there on demand;
- ``python -m torchdist_ext.fr_trace DIR`` runs torch's trace analyzer
  (``torch.distributed.flight_recorder``) on every rank's file in DIR, with tdx's entries accepted
  (torch's analyzer knows only its own backends' names); it names the first collective the ranks
  disagree on and the ranks that did not issue it. Its options are torch's (``--help``).
"""
import json
import pickle
import sys

from . import _C

__all__ = ["enabled", "dump_fr_trace", "dump_fr_trace_json", "dump_fr_trace_to_file", "main"]


def enabled() -> bool:
    """Whether tdx records its calls (``TORCH_FR_BUFFER_SIZE`` above 0 when the first group was made)."""
    return _C.fr_enabled()


def dump_fr_trace(includeCollectives: bool = True, includeStackTraces: bool = True,
                  onlyActive: bool = False) -> bytes:
    """tdx's flight recorder, pickled as torch's ``_dump_fr_trace()`` pickles its own.

    Args (torch's): includeCollectives: the entries too; includeStackTraces: each entry's caller
    stack (``frames``); onlyActive: only the calls not completed yet. With the recorder off the
    dump holds no entries (see :func:`enabled`).
    """
    return _C.fr_dump(bool(includeCollectives), bool(includeStackTraces), bool(onlyActive))


def dump_fr_trace_json(includeCollectives: bool = True, onlyActive: bool = False) -> bytes:
    """The same as JSON (no stacks, as torch's ``_dump_fr_trace_json()``)."""
    dump = pickle.loads(dump_fr_trace(includeCollectives, False, onlyActive))
    return json.dumps(dump, sort_keys=True).encode()


def dump_fr_trace_to_file(rank: int = None) -> str:
    """Writes :func:`dump_fr_trace` where a failed call writes it, through torch's own writer:
    ``$TORCH_FR_DUMP_TEMP_FILE<rank>`` (torch's default: ``~/.cache/torch/comm_lib_trace_rank_<rank>``),
    making the folder; rank: this process's global rank when not given. Returns the path: the files
    ``python -m torchdist_ext.fr_trace <folder>`` reads, one per rank."""
    if rank is None:
        import torch.distributed as dist
        if not dist.is_initialized():
            raise ValueError("dump_fr_trace_to_file: pass rank= (no default process group to take it from)")
        rank = dist.get_rank()
    return _C.fr_write(int(rank))


def _accept_tdx():
    """torch's analyzer parses each entry's ``backend:op`` name and knows only its own backends;
    tdx's entries are read as gloo's (the same ops, the same layout), their names kept."""
    from torch.distributed.flight_recorder.components import types

    if getattr(types.Op, "_tdx_accepted", False):
        return
    original = types.Op.__init__

    def __init__(self, event, *args, **kwargs):
        name = event.get("profiling_name", "")
        if name.startswith("tdx:"):
            event = dict(event, profiling_name="gloo:" + name[len("tdx:"):])
        original(self, event, *args, **kwargs)
        self.profiling_name = name

    types.Op.__init__ = __init__
    types.Op._tdx_accepted = True


def main(args=None):
    """``python -m torchdist_ext.fr_trace DIR [torch's options]``: torch's analyzer on tdx dumps."""
    try:
        from torch.distributed.flight_recorder import fr_trace
    except ImportError as e:  # pragma: no cover - torch without the analyzer
        raise SystemExit(f"torchdist_ext.fr_trace: this torch has no flight recorder analyzer ({e}); "
                         "read the dumps with pickle instead") from e
    _accept_tdx()
    fr_trace.main(sys.argv[1:] if args is None else args)


if __name__ == "__main__":
    main()
