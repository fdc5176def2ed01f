"""What every elastic trainer shares: the step loop that retries a failed step, and the recovery
skeleton (gone ranks, shrink, same-step check, sampler re-split, the record of each recovery).
ElasticDDP (_ddp.py), ElasticFSDP (_fsdp.py) and ElasticPipeline (_pipeline.py) fill in what is theirs: the attempt, the commit
and the rebuild for the new world size."""
import math
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from . import _liveness, _rejoin
from ._group import SHRINK_ABORT, RankExcludedError, _tdx_backend, gone_ranks, note_progress, shrink_group, watch_stuck
from ._group import excluded as excluded_why


def resplit_sampler(sampler, rank, world_size):
    """Points a ``DistributedSampler`` at ``rank`` of ``world_size`` ranks from its next epoch on
    (the epoch being iterated keeps its indices)."""
    sampler.rank, sampler.num_replicas = rank, world_size
    n = len(sampler.dataset)
    if sampler.drop_last and n % world_size:
        sampler.num_samples = math.ceil((n - world_size) / world_size)
    else:
        sampler.num_samples = math.ceil(n / world_size)
    sampler.total_size = sampler.num_samples * world_size


def repoint_optimizer(optimizer, params_per_group, states):
    """Points ``optimizer``'s parameter groups at new parameters (one list per group; the groups'
    hyper-parameters stay) with their optimizer state ``{parameter: state}``: the same object goes
    on, so LR schedulers keep working."""
    if len(params_per_group) != len(optimizer.param_groups):
        raise ValueError(f"torchdist_ext.elastic: optimizer_fn made {len(params_per_group)} parameter groups for the "
                         f"rebuilt parameters but the optimizer has {len(optimizer.param_groups)}; it must make the "
                         "same groups whatever parameters it is given")
    for group, params in zip(optimizer.param_groups, params_per_group):
        group["params"] = list(params)
    optimizer.state = defaultdict(dict)
    for params in params_per_group:
        for p in params:
            if states.get(p):
                optimizer.state[p] = states[p]


class ElasticTrainer:
    """Base of the elastic trainers. Subclasses implement:

    - ``_attempt(*what)`` (what ``step`` passes to ``_retrying``; ``(loss_fn, args, kwargs)`` by
      default): everything of a step that may fail because a peer died (zero_grad, forward,
      backward, whatever exchange must finish before the optimizer may step); returns the loss;
    - ``_commit()``: the optimizer step (runs only after an attempt that every rank finished);
    - ``_before_shrink()``: detach what still hooks into the old group (optional);
    - ``_rebuild(excluded, old_world_size)``: the wrapper (and whatever state) over the new group;
    - ``_check_recoverable(gone, error)``: raise when the survivors cannot recover (optional);
    - ``_catch_up(src, behind, why)``: after a shrink, bring the survivors one step behind to the
      step of the ones ahead (collective; optional: by default the survivors raise);
    - ``_before_reform()`` / ``_share_state()``: with ``rejoin``, what the members gather on the old
      group before a joiner enters, then the wrapper and state over the new group, sent from rank 0
      (collective over the new group, the joiner included).
    """

    def __init__(self, process_group, sampler, max_recoveries, rejoin=False, rejoin_every=1):
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.sampler = sampler
        self.max_recoveries = max_recoveries
        self.steps_done = 0
        self.recoveries = []
        # Original group rank of every current member (the ranks of the group this trainer started on).
        self.members = list(range(dist.get_world_size(self.process_group)))
        _tdx_backend(self.process_group)  # refuses a group that is not on tdx, now
        _liveness.start(self.process_group)  # with the store in etcd: a lost host's ranks can be told
        self._watching = None  # the group the stuck-rank watch is armed on (from the first step on)
        self.rejoins = []
        self.generation = 0  # +1 at each admission of joiners
        self.generation_began = 0  # steps_done when the current generation's group was formed
        self._joining = None
        self._rejoin = None
        if rejoin:
            self._start_rejoin(rejoin_every)

    # -- a node comes back (_rejoin.py has the keys and the joiner's half) ------------------------

    def _start_rejoin(self, every):
        if self.process_group is not dist.group.WORLD:
            raise ValueError("torchdist_ext.elastic: rejoin=True needs the trainer on the default process group "
                             "(a joiner re-forms the default group at the larger size); pass process_group=None")
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"torchdist_ext.elastic: rejoin_every={every!r} must be an int >= 1 (steps between "
                             "checks for a joiner)")
        store = _rejoin.base_store(self.process_group)
        self._rejoin = {"store": store, "every": every, "admitted": 0, "reformed": False, "checked_at": None, "epoch": None, "slot": None,
                        "step_in_epoch": 0, "override": {}, "timeout": _rejoin.store_timeout(store),
                        "watcher": _rejoin.Watcher(store)}
        if self.sampler is not None:
            self._wrap_set_epoch()
        record = _rejoin.joined()
        if record is not None and record.get("trainer_built") is None:
            record["trainer_built"] = True
            self._joining = record
            self._receive_meta(record)
        else:
            self._start_after_earlier_runs(store)

    def _start_after_earlier_runs(self, store):
        """A fresh job marks itself running. The tickets and generations an earlier job left in the
        same store (a requeued job on the same prefix) are not this job's: it counts from them, so
        no stale ticket is admitted and no generation's keys are met twice (one broadcast)."""
        t = torch.zeros(2, dtype=torch.int64)
        if self.rank == 0:
            t[0], t[1] = _rejoin.earlier_runs(store)
        dist.broadcast(t, src=dist.get_global_rank(self.process_group, 0), group=self.process_group)
        self._rejoin["admitted"], self.generation = int(t[0]), int(t[1])
        if self.rank == 0:
            _rejoin.mark_running(store, self.generation)

    def _wrap_set_epoch(self):
        """The sampler's ``set_epoch`` checks for joiners when an epoch starts (every member calls it
        there, before its loader draws the epoch's indices), then splits the epoch over the group."""
        sampler, state = self.sampler, self._rejoin
        torch_set_epoch = sampler.set_epoch

        def set_epoch(epoch):
            torch_set_epoch(epoch)
            if state["epoch"] is None or epoch > state["epoch"]:
                self._check_joiners(epoch_start=epoch)
            resplit_sampler(sampler, *state["override"].get(epoch, (self.rank, self.world_size)))

        sampler.set_epoch = set_epoch

    def _note_epoch(self):
        """Where this rank stands in the data: the epoch, its slot of that epoch's split, steps done."""
        state = self._rejoin
        if self.sampler is not None and self.sampler.epoch != state["epoch"]:
            state["epoch"], state["step_in_epoch"] = self.sampler.epoch, 0
            state["slot"] = (self.sampler.rank, self.sampler.num_replicas)

    def joiners_waiting(self):
        """How many announced joiners this rank's watcher has seen that are not admitted yet."""
        return 0 if self._rejoin is None else max(0, self._rejoin["watcher"].count - self._rejoin["admitted"])

    def _check_joiners(self, epoch_start):
        """At ``epoch_start`` (from the sampler's ``set_epoch``): admits the announced joiners into a
        split of that epoch at the larger size. A failure of a peer here is recovered from, and the
        check is left to the next step (where the ranks that did not see it fail and recover)."""
        try:
            self._admit(epoch_start)
        except RuntimeError as error:
            if self._rejoin["reformed"]:
                raise
            self._recover(error)

    def _admit(self, epoch_start):
        """Collective over the members: admits the announced joiners when rank 0 has seen one, either
        into the slots of ranks lost in the current epoch (mid-epoch) or, at ``epoch_start``, into a
        split of that epoch at the larger size."""
        state = self._rejoin
        state["reformed"] = False
        if epoch_start is None:
            seen = _rejoin.tickets_seen_before(state, state["watcher"], self.process_group)
        else:
            seen = _rejoin.tickets_seen(state["watcher"], self.process_group)
        waiting = list(range(state["admitted"] + 1, seen + 1))
        if not waiting:
            return
        world = self.world_size
        if epoch_start is not None:
            n = len(waiting)
            where = [{"epoch": epoch_start, "step": 0, "slot": world + i, "slots": world + n} for i in range(n)]
        elif self.sampler is None:
            n = len(waiting)
            where = [{"epoch": None, "step": self.steps_done, "slot": None, "slots": None}] * n
        else:
            mine = (state["epoch"], state["step_in_epoch"], state["slot"][0], state["slot"][1])
            every = [None] * world
            dist.all_gather_object(every, mine, group=self.process_group)
            if len({(e, s, n) for e, s, _, n in every}) != 1:
                raise RuntimeError(f"torchdist_ext.elastic: the members disagree on the epoch, step or split "
                                   f"(epoch, step, slot, slots per rank: {every}); they cannot admit a joiner")
            epoch, step, _, slots = every[0]
            free = sorted(set(range(slots)) - {slot for _, _, slot, _ in every})
            n = min(len(waiting), len(free))
            if n == 0:
                return  # no slot free in this epoch: admitted when the next epoch starts
            where = [{"epoch": epoch, "step": step, "slot": free[i], "slots": slots} for i in range(n)]
        started = time.perf_counter()
        tickets, generation = waiting[:n], self.generation + 1
        if self.rank == 0:
            _rejoin.admit(state["store"], tickets, generation, world + n, where)
        pending = state.pop("pending", None)
        if pending is not None:
            pending[0].wait()  # every member started it: nothing of the old group stays in flight
        self._before_reform()
        state["reformed"] = True
        try:
            _rejoin.reform(state["store"], generation, self.rank, world + n, "tdx", state["timeout"])
        except (RuntimeError, dist.DistError) as error:
            raise RuntimeError(f"torchdist_ext.elastic: re-forming the group at {world + n} ranks (generation "
                               f"{generation}) for the joiners of tickets {tickets} failed: {error}. A joiner that "
                               "died after it announced itself never arrives; a member that died meanwhile is "
                               "not recovered here. Restart the job (from a checkpoint)") from error
        reformed = time.perf_counter()
        self.process_group = dist.group.WORLD
        self._send_meta(tickets, generation)
        self._share_state()
        if self.sampler is not None and epoch_start is None:
            resplit_sampler(self.sampler, self.rank, self.world_size)
        state["reformed"] = False
        done = time.perf_counter()
        self.rejoins.append({"step": self.steps_done, "admitted": [_rejoin.who(state["store"], t) for t in tickets],
                             "world_size": self.world_size, "generation": generation, "seconds": done - started,
                             "reform_seconds": reformed - started, "state_seconds": done - reformed})

    def _send_meta(self, tickets, generation):
        state = self._rejoin
        state["admitted"], self.generation, self.generation_began = tickets[-1], generation, self.steps_done
        self.members = list(range(self.world_size))
        meta = [{"steps_done": self.steps_done, "admitted": state["admitted"], "generation": generation,
                 "checked_at": state["checked_at"]}]
        dist.broadcast_object_list(meta, src=0, group=self.process_group)

    def _receive_meta(self, record):
        """The joiner's half of ``_send_meta``, and its place in the data."""
        meta = [None]
        dist.broadcast_object_list(meta, src=0, group=self.process_group)
        state = self._rejoin
        self.steps_done, state["admitted"] = meta[0]["steps_done"], meta[0]["admitted"]
        self.generation, state["checked_at"] = meta[0]["generation"], meta[0]["checked_at"]
        self.generation_began = self.steps_done
        if self.sampler is not None and record["epoch"] is not None:
            state["override"][record["epoch"]] = (record["slot"], record["slots"])
            state["epoch"], state["step_in_epoch"] = record["epoch"], record["step"]
            state["slot"] = (record["slot"], record["slots"])
            self.sampler.set_epoch(record["epoch"])

    def _before_reform(self):
        """Before the group is re-formed for a joiner (collective over the old group)."""
        self._before_shrink()

    def _share_state(self):
        raise NotImplementedError(f"{type(self).__name__} cannot admit a joiner yet (rejoin=True)")

    @property
    def rank(self):
        return dist.get_rank(self.process_group)

    @property
    def world_size(self):
        return dist.get_world_size(self.process_group)

    def step(self, loss_fn, *args, **kwargs):
        """One training step, retried on the survivors when a peer fails; returns the loss (detached)."""
        if self._rejoin is not None:
            self._note_epoch()
        return self._retrying(loss_fn, args, kwargs)

    def _retrying(self, *what):
        """``_attempt(*what)`` until it completes on the survivors, then ``_commit()``; returns the
        attempt's loss, detached (None where the attempt has none)."""
        while True:
            if self._watching is not self.process_group:  # from the first step (construction may import
                watch_stuck(self.process_group)  # for seconds) and after each recovery: stuck ranks
                self._watching = _liveness.watching = self.process_group
            try:
                state = self._rejoin
                if state is not None and self.steps_done % state["every"] == 0 and state["checked_at"] != self.steps_done:
                    # Marked before it runs: after a failure here or in the attempt, every rank retries
                    # from the attempt (a rank whose broadcast completed may fail only in the attempt).
                    state["checked_at"] = self.steps_done
                    self._admit(None)
                loss = self._attempt(*what)
            except RuntimeError as error:
                if self._rejoin is not None and self._rejoin["reformed"]:
                    raise  # a failure while the group is re-formed for a joiner is not survived
                if not self._recover(error):
                    continue
                loss = None  # this step completed on a survivor that went on: its state was taken from there
            else:
                self._commit()
            self.steps_done += 1
            note_progress()
            if self._rejoin is not None:
                self._rejoin["step_in_epoch"] += 1
            return None if loss is None else loss.detach()

    def _attempt(self, loss_fn, args, kwargs):
        raise NotImplementedError

    def _commit(self):
        raise NotImplementedError

    def _before_shrink(self):
        pass

    def _rebuild(self, excluded, old_world_size):
        raise NotImplementedError

    def _check_recoverable(self, gone, error):
        pass

    def _recover(self, error):
        """Shrinks the group to the survivors of ``error`` and rebuilds the trainer on it; returns
        whether this rank's failed step completed elsewhere and was taken from there (``_agree_on_step``)."""
        started = time.perf_counter()
        why = excluded_why(self.process_group)
        if why:  # this rank was stuck (or left out) and the others went on: it must not rejoin them here
            raise RankExcludedError(f"torchdist_ext.elastic: {why}. The other ranks went on without it "
                                    "(see trainer.recoveries there); this process can take no further part "
                                    "and must exit. Restart it to rejoin, or raise TDX_FAILURE_DETECTION_S "
                                    "if pauses that long are expected") from error
        # A recovery is not watched (its rebuild may take a while on one rank): the new group inherits
        # the disarmed watch; the next step arms it again.
        watch_stuck(self.process_group, 0)
        self._watching = _liveness.watching = None
        gone = gone_ranks(self.process_group)
        if not gone or (self.max_recoveries is not None and len(self.recoveries) >= self.max_recoveries):
            raise error
        self._check_recoverable(gone, error)
        _liveness.revoke(self.process_group, gone)  # with etcd: the excluded ranks' store writes fail from now
        # The failed step's graph and the old wrapper's hooks must not reach the retry.
        error.__traceback__ = None
        self._before_shrink()
        excluded = sorted(gone)
        old_world_size = self.world_size
        if self._rejoin is not None:
            self._rejoin.pop("pending", None)  # a check's broadcast on the old group, abandoned with it
        group = shrink_group(excluded, self.process_group, SHRINK_ABORT)
        self.members = [m for i, m in enumerate(self.members) if i not in gone]
        self.process_group = group
        caught_up = self._agree_on_step()
        self._rebuild(excluded, old_world_size)
        if self.sampler is not None:
            resplit_sampler(self.sampler, self.rank, self.world_size)
        self.recoveries.append({"step": self.steps_done + caught_up, "excluded": [f"rank {r}: {why}" for r, why in gone.items()],
                                "world_size": self.world_size, "seconds": time.perf_counter() - started,
                                "caught_up": caught_up})
        return caught_up

    def _agree_on_step(self):
        """The survivors' last completed steps. A collective can complete on one rank and be
        interrupted on another (the failure reached them at different moments), so some may have
        stepped once more than others: every survivor calls ``_catch_up`` (the ones behind reach
        the step of the ones ahead, e.g. from the lowest rank ahead's state) and the ones behind
        count that step as done. Returns whether this rank caught up so (its current ``step`` call
        then returns). More than one step apart, or a trainer that cannot catch up, raises."""
        t = torch.tensor([self.steps_done, -self.steps_done], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
        ahead, behind = int(t[0]), -int(t[1])
        if self._rejoin is not None:
            self._rejoin["checked_at"] = ahead  # no check at the step the ones ahead are already in
        if ahead == behind:
            return False
        why = (f"torchdist_ext.elastic: the survivors disagree on the last completed step (from {behind} to {ahead}; "
               f"this rank: {self.steps_done}); some stepped the optimizer before the failure reached them")
        if ahead - behind > 1:
            raise RuntimeError(why + ", more than one step apart, so they cannot continue together")
        src = torch.tensor([self.rank if self.steps_done == ahead else self.world_size], dtype=torch.int64)
        dist.all_reduce(src, op=dist.ReduceOp.MIN, group=self.process_group)
        self._catch_up(int(src), self.steps_done != ahead, why)
        return self.steps_done != ahead  # the caller counts the step as done on this rank too

    def _catch_up(self, src, behind, why):
        """Every survivor (collective): those ``behind`` reach the step of the ones ahead, of which
        group rank ``src`` is the lowest; ``why`` begins the error to raise when they cannot."""
        raise RuntimeError(why + f", and {type(self).__name__} cannot bring the ones behind to the step of the ones "
                           "ahead, so they cannot continue together")
