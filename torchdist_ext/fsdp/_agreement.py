"""Every rank must issue the same FSDP collectives in the same order: the same units gathered in
forward and backward, the same units' gradients reduced. A unit that runs, or gets gradients, on
some ranks only (a branch taken on some ranks, an output left out of the loss there) breaks that;
unchecked, the collectives of different units pair up: a hang, a size-mismatch error that names no
unit, or, for units of equal size, silently mixed parameters or gradients.

So before each gather and each reduction the ranks agree on what comes next (a tiny all-gather
of (kind, unit) per collective) and, when they differ, every rank raises the same error naming
the units and ranks, before any mixed data exists.
"""
import torch
import torch.distributed as dist

__all__ = ["Agreement"]

GATHER, REDUCE, END_OF_BACKWARD = 1, 2, 3
_KIND = {GATHER: "gathering the parameters of", REDUCE: "reducing the gradients of"}


class Agreement:
    """Checks that every rank of ``group`` is at the same (kind, unit) step."""

    def __init__(self, group, units, root_module, device):
        self.group = group
        self.world = dist.get_world_size(group)
        self.device = device
        names = {id(m): n for n, m in root_module.named_modules()}
        self.labels = [f"unit {u.index} ('{names.get(id(u.module)) or '<root>'}', {type(u.module).__name__})"
                       for u in units]

    def check(self, kind, unit_index=-1):
        """All-gathers (kind, unit) from every rank; raises RuntimeError on every rank if they differ."""
        if self.world == 1:
            return
        mine = torch.tensor([kind, unit_index], dtype=torch.int64, device=self.device)
        everyone = torch.empty(self.world * 2, dtype=torch.int64, device=self.device)
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(everyone, mine, group=self.group)
        steps = [tuple(x) for x in everyone.view(self.world, 2).tolist()]
        if len(set(steps)) > 1:
            raise RuntimeError(self._message(steps))

    def _describe(self, step):
        kind, index = step
        if kind == END_OF_BACKWARD:
            return "finished backward with no further unit to reduce"
        return f"{_KIND[kind]} {self.labels[index]}"

    def _message(self, steps):
        by_step = {}
        for rank, step in enumerate(steps):
            by_step.setdefault(step, []).append(rank)
        where = "; ".join(f"ranks {ranks} {self._describe(step)}" for step, ranks in sorted(by_step.items(),
                                                                                             key=lambda kv: kv[1]))
        units = sorted({self.labels[i] for k, i in steps if k != END_OF_BACKWARD})
        return (f"FullyShardedDataParallel: the ranks disagree on the next collective: {where}. Every rank must run "
                f"the same wrapped units in forward and get gradients for the same units in backward, since each "
                f"unit's all-gather and reduce-scatter involve every rank; here {' or '.join(units)} ran or got "
                "gradients on some ranks only (a branch taken on some ranks only, or an output left out of the loss "
                "there). Fix: let every rank "
                "run the unit and use its output (e.g. add 0.0 * out.sum() to the loss on the others), or leave "
                "it out of auto_wrap_policy so that it shares a unit with parameters every rank uses (its "
                "gradient then counts as zero where it was not used)")
