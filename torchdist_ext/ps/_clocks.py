"""The consistency rule of a server, as data: worker clocks, who waits, when a reply may go.

A worker's clock is the number of its pushes a server has taken. ``push`` records the push's
staleness (its clock minus the slowest live worker's) and says whether the server steps now;
``release`` names the waiting workers whose reply may go: a worker at clock c only once every live
worker is at c - s or later (s = 0 for "sync", no bound for "async"). "sync" steps once every live
worker pushed (the mean of their gradients); "async" and "ssp" step on every push.
"""
from collections import Counter

__all__ = []


class Clocks:
    def __init__(self, workers, mode, staleness):
        self.mode = mode
        self.bound = {"sync": 0, "ssp": staleness, "async": None}[mode]
        self.live = set(workers)
        self.clock = {w: 0 for w in workers}
        self.waiting = set()
        self.pending = 0  # sync: pushes summed into the step not yet taken
        self.staleness = Counter()

    def min_live(self):
        return min((self.clock[w] for w in self.live), default=0)

    def push(self, w, c):
        """Takes worker ``w``'s push made at clock ``c``; returns True when the server steps now."""
        if w not in self.clock:
            raise RuntimeError(f"ps server: a push names rank {w}, which is not a worker of this job")
        if c != self.clock[w]:
            raise RuntimeError(f"ps server: worker rank {w} pushed at clock {c} but the server has taken "
                               f"{self.clock[w]} of its pushes (messages lost or reordered)")
        self.staleness[c - self.min_live()] += 1
        self.clock[w] = c + 1
        self.waiting.add(w)
        if self.mode != "sync":
            return True
        self.pending += 1
        return self._sync_complete()

    def remove(self, w):
        """Worker ``w`` finished or died; returns True when a pending "sync" step is now complete."""
        self.live.discard(w)
        self.waiting.discard(w)
        return self.mode == "sync" and self._sync_complete()

    def _sync_complete(self):
        return self.pending > 0 and self.live <= self.waiting

    def take_pending(self):
        """The count of pushes in the step being taken ("sync"), reset to 0."""
        n, self.pending = self.pending, 0
        return n

    def release(self):
        """The waiting live workers whose reply may go now (removed from waiting), in rank order."""
        floor = self.min_live()
        out = sorted(w for w in self.waiting if self.bound is None or self.clock[w] - floor <= self.bound)
        self.waiting.difference_update(out)
        return out
