"""Shrinking a tdx process group in place, and finding which ranks are gone."""
import datetime

import torch
import torch.distributed as dist

from .. import _C
from .._backend import _tdx_backend_of
from . import _liveness
from ._errors import RankExcludedError  # noqa: F401  (re-exported: the trainers and the package take it from here)

SHRINK_DEFAULT = 0
SHRINK_ABORT = 1


def _tdx_backend(group):
    group = group if group is not None else dist.group.WORLD
    if group is None:
        raise RuntimeError("torchdist_ext.elastic: no process group; call torch.distributed.init_process_group first")
    backend = _tdx_backend_of(group)
    if backend is None:
        raise TypeError(f"torchdist_ext.elastic: group {group.group_name!r} runs on {dist.get_backend(group)!r}, not "
                        "on tdx; elastic recovery needs a tdx group (init_process_group('tdx'))")
    return backend


def gone_ranks(group=None):
    """``{group rank: why}`` for every rank of ``group`` whose process exited or announced that it
    is failing (an uncaught exception, a non-zero ``sys.exit``, a fatal signal). A rank whose
    collective failed only because another rank died is not listed. In a group spanning hosts, a
    rank of another host is listed once its host mate saw it gone (that host mate's own
    ``gone_ranks``, which leaves a note in the group's store; this call waits up to
    ``TDX_FAILURE_DETECTION_S`` / 2.5 for one). With the store in etcd (``TDX_STORE``) and an
    elastic trainer on the group, the ranks of a lost host (no host mate left to leave a note) are
    listed once the liveness watch knows them gone: at once when their processes ended (their
    liveness connections closed, or their ports refuse a connection), else when their liveness
    lease expired; when nothing else is gone, this call waits up to ``TDX_FAILURE_DETECTION_S``
    * 1.4 for that. A host mate that armed the stuck-rank watch (``watch_stuck``, done by elastic
    trainers) and has shown no progress for ``TDX_FAILURE_DETECTION_S`` is listed too, and excluded
    (fenced) from then on."""
    backend = _tdx_backend(group)
    known = _liveness.known_gone(group)
    if not known:  # the hosts a failed collective named: a refused connection there says enough
        _liveness.probe_hosts(group, backend.failed_hosts())
        known = _liveness.known_gone(group)
    if known:  # the rest of those hosts' ranks, which end together with them
        _liveness.settle(group)
        known = _liveness.known_gone(group)
    note_wait = 0.0 if known else _liveness.note_wait_seconds()
    gone = dict(backend.gone_ranks(datetime.timedelta(seconds=note_wait)))
    for r, why in known.items():
        gone.setdefault(r, why)
    wait = 0.0 if gone else _liveness.detection_seconds() + _liveness.note_wait_seconds()
    for r, why in _liveness.silent_ranks(group, wait).items():
        gone.setdefault(r, why)
    return gone


def watch_stuck(group=None, seconds=None):
    """Arms the stuck-rank watch for this rank on ``group``: from now on, a peer of this host that
    waits on this rank excludes it (a fence in the group's shared memory) once it has shown no
    progress for ``seconds`` (default ``TDX_FAILURE_DETECTION_S``): no collective, no wait in one,
    no finished trainer step. ``seconds=0`` disarms it. Elastic trainers arm it at their first step
    and disarm it while they recover; a rank that never arms it is never excluded."""
    _tdx_backend(group).set_stuck_timeout(_liveness.detection_seconds() if seconds is None else seconds)


def note_progress():
    """Records that this rank is making progress, in every tdx group of the process: call it in a
    long stretch of work outside the trainer's ``step`` (an evaluation on one rank, writing a
    checkpoint) that may exceed ``TDX_FAILURE_DETECTION_S``, so that the peers do not exclude the
    rank as stuck. Each trainer step, collective and wait records it already."""
    _C.note_progress()


def excluded(group=None):
    """``""`` unless this rank was excluded from ``group`` by its peers; then why."""
    return _tdx_backend(group).excluded()


def shrink_group(ranks_to_exclude, group=None, shrink_flags=SHRINK_DEFAULT, pg_options=None):
    """``torch.distributed.shrink_group`` for tdx groups. It needs torch >= 2.13, where torch has
    ``shrink_group``; on older torch it raises ``NotImplementedError``.

    The ranks not in ``ranks_to_exclude`` (group ranks of ``group``, default: the default group)
    call it together; they form a new group over shared memory, renumbered in order, without a
    new rendezvous through the store (a group spanning hosts re-forms its Gloo part among the
    survivors through the store, which must still be reachable). ``SHRINK_ABORT`` first
    interrupts operations in flight on ``group``. ``group`` is destroyed; when it is the default
    group the new group becomes the default one (and torch destroys every other group). Returns
    the new group.
    """
    if hasattr(dist, "shrink_group"):
        return dist.shrink_group(list(ranks_to_exclude), group, shrink_flags, pg_options)
    raise NotImplementedError(f"torchdist_ext.elastic.shrink_group needs torch >= 2.13 (torch.distributed."
                              f"shrink_group registers the new group); this is torch {torch.__version__}")
