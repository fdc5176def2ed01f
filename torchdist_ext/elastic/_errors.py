"""The error of a rank the others excluded from its group (raised by the trainers and the liveness
check; its own module so that both can import it)."""

__all__ = ["RankExcludedError"]


class RankExcludedError(RuntimeError):
    """This rank was excluded from its group by the others (it made no progress for the stuck time,
    ``TDX_FAILURE_DETECTION_S``, its liveness key in etcd went, or a shrink left it out) and can take
    no further part in it. The others went on without it; the process should exit (and be restarted
    to rejoin)."""
