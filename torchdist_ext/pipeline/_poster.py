"""Point-to-point operations posted from one background thread, for backends whose ``isend`` and
``irecv`` do their work in the caller.

Gloo (and a tdx group spanning hosts, whose messages Gloo carries) writes a message into its
socket inside ``isend`` when the receiver has posted its receive, and posting a receive sends
the sender a notice, inside ``irecv``: each a system call, and on a loaded machine a wake-up of
the peer's threads that can take the caller's core. Measured with 2 ranks on a 2-core machine
(`scripts/dev/profile_pipeline_zb.py --backend gloo`): 0.15-0.3 ms per call on the pipeline's
critical path. Posted from this thread, they overlap the computation that follows them instead.

One thread per schedule, posting in the order the operations are given, so two operations of one
flow (same peer, same tag) reach the backend in the order the schedule gave them. An exception
from the backend while posting is raised by the operation's ``wait()``. Operations are posted
through the group's own ``send``/``recv`` with group ranks, as ``dist.isend``/``dist.irecv`` do.
"""
import atexit
import queue
import threading
import time
import weakref

__all__ = ["Poster"]


class _Posted:
    """The handle of an operation handed to the poster: ``wait()`` waits until it is posted, then for it."""

    __slots__ = ("_posted", "_work", "_error", "_thread")

    def __init__(self, thread):
        self._posted = threading.Event()
        self._work = None
        self._error = None
        self._thread = thread

    def wait(self):
        while not self._posted.wait(1.0):
            if not self._thread.is_alive() and not self._posted.is_set():
                raise RuntimeError("internal: the pipeline's poster thread ended before posting this operation")
        if self._error is not None:
            raise self._error
        if self._work is not None:
            self._work.wait()
        return True


class Poster:
    """A background thread posting one process group's point-to-point operations, in order.

    Owned by a schedule: :meth:`stop` (called when the schedule is collected, and for every live
    poster at exit) ends the thread once what was given to it is posted.
    """

    def __init__(self, group):
        self._group = group
        self._queue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="tdx-pipeline-poster", daemon=True)
        self._thread.start()
        _live.add(self)

    def isend(self, tensor, group_dst, tag):
        return self._put("send", tensor, group_dst, tag)

    def irecv(self, tensor, group_src, tag):
        return self._put("recv", tensor, group_src, tag)

    def _put(self, kind, tensor, peer, tag):
        handle = _Posted(self._thread)
        with self._lock:
            if not self._stopped:
                self._queue.put((handle, kind, tensor, peer, tag))
                return handle
        self._post(handle, self._group, kind, tensor, peer, tag)  # stopped: posted here, as without a poster
        return handle

    @staticmethod
    def _post(handle, group, kind, tensor, peer, tag):
        try:
            if kind == "send":
                handle._work = group.send([tensor], peer, tag)
            elif kind == "recv":
                handle._work = group.recv([tensor], peer, tag)
        except BaseException as err:  # raised by the operation's wait()
            handle._error = err
        handle._posted.set()

    def _loop(self):
        try:
            while True:
                item = self._queue.get()
                if item is None:
                    return
                self._post(item[0], self._group, *item[1:])
        finally:
            _live.discard(self)

    def abandon(self, timeout=10.0):
        """After a failed step: what was given but not posted yet is not posted (its wait() raises), and
        the thread is idle when this returns (or ``timeout`` s have passed)."""
        dropped = RuntimeError("not posted: the pipeline step failed before")
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is None:  # stopped meanwhile: the thread ends once it sees this
                self._queue.put(None)
                break
            item[0]._error = dropped
            item[0]._posted.set()
        marker = self._put(None, None, None, None)
        marker._posted.wait(timeout)

    def stop(self, timeout=None):
        """Ends the thread after what was given to it; waits up to ``timeout`` s (None: does not wait).
        Operations given after this are posted by the caller's thread."""
        with self._lock:
            if not self._stopped:
                self._stopped = True
                self._queue.put(None)
        if timeout is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)


_live = weakref.WeakSet()


@atexit.register
def _stop_posters(timeout=2.0):
    """Ends the threads before the interpreter finalizes: one ended by finalization while inside the
    backend (the GIL released in C++) would abort the process."""
    deadline = time.monotonic() + timeout
    for poster in list(_live):
        poster.stop(max(0.0, deadline - time.monotonic()))
