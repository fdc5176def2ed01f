"""The elastic event soak: random faults over one long ElasticDDP run (rejoin=True), each followed by
a restart of what was lost, on test hosts with the store in etcd (a member on each of 3 hosts).

Layout: 3 test hosts x 2 ranks (6 ranks, tests/_hostjob.py with TDX_STORE, the same command at the
first start and at every restart). An event driver in the test process picks events with a seeded
RNG (TDX_SOAK_SEED, default 38) from:

- ``rank``: SIGKILL one rank;
- ``host``: SIGKILL both ranks of one host (its etcd member stays);
- ``stop``: SIGSTOP one rank until the survivors excluded it (TDX_FAILURE_DETECTION_S), then
  SIGCONT: it must exit by itself with ``RankExcludedError``;
- ``cut``: cut one host's link (``TestHosts.set_link``) until its ranks are excluded, then restore
  it: the cut-off ranks must exit by themselves with an error.

After each fault it waits until every survivor reports a completed step at the smaller width (each
process appends one line per step to ``steps-<pid>.txt``), restarts the lost processes with the
same command (``init_distributed`` finds the job running and joins it), and waits until every
process trains at full width again, before the next event. At the end the ranks stop at one agreed
step; every rank's final parameters hash the same, no process is left on any host, and every
host's private /dev/shm is empty. Every wait is bounded (WAIT_S): a hang fails the test with the
event log, the ranks' logs with their stacks (faulthandler on SIGUSR1) and the job's shrink and
liveness keys in etcd. Each event logs its times (fault -> the survivors' next step at the smaller
width, restart -> every rank training at full width). No kind of event is left out.

``test_elastic_soak_events`` (default run): 5 events, each kind once and one drawn, in a seeded
order (TDX_SOAK_KINDS=host,cut,... replays a given sequence instead).
``test_elastic_soak_long`` (``-m soak``): TDX_SOAK_EVENTS events (default 100), each kind drawn;
TDX_SOAK_LOG names a file that receives the event log (appended line by line).
"""
import faulthandler
import glob
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from _elastic_runs import batches, dataset
from _testhosts import _pids_in_netns
from test_elastic_rejoin import _loss, _params, _trainer
from test_etcd_store import HERE, REPO, cluster  # noqa: F401  (cluster: the fixture)

HOSTS, PER_HOST = 3, 2
FULL = HOSTS * PER_HOST
KINDS = ("rank", "host", "stop", "cut")
DETECTION_S = 5  # TDX_FAILURE_DETECTION_S of the ranks (the default)
STEP_S = 0.02  # a pause in each step: 6 ranks and 3 etcd members share the machine's cores
STOP_MARGIN = 15  # steps between the test's stop decision and the step every rank stops at
WAIT_S = 240  # the bound on every wait of the driver (a restart took up to 115 s at load 45 on 2 cores)


# ------------------------------------------------------------------ the job (in each rank's process)

def _stop_at(out):
    try:
        with open(os.path.join(out, "stop")) as f:
            return int(f.read())
    except (FileNotFoundError, ValueError):
        return None


def _soak_job(env_rank, ws, out):
    """Trains until the step written to ``out/stop``; one line per completed step to
    ``out/steps-<pid>.txt`` (time, steps done, world size, generation, recoveries)."""
    from torchdist_ext.elastic import RankExcludedError
    from torchdist_ext.elastic._rejoin import joined

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver's dump of a hang
    record = joined()
    ds = dataset()
    trainer, sampler = _trainer("ddp", ds, dist.get_world_size(), dist.get_rank())
    epoch, skip = (record["epoch"], record["step"]) if record else (0, 0)
    pid = os.getpid()
    log = open(os.path.join(out, f"steps-{pid}.txt"), "a", buffering=1)
    try:
        while True:
            for step, (x, y) in enumerate(batches(ds, sampler, epoch)):
                if step < skip:
                    continue
                stop = _stop_at(out)
                if stop is not None and trainer.steps_done >= stop:
                    params = torch.cat([p.reshape(-1) for p in _params(trainer)])
                    result = {"hash": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
                              "steps_done": trainer.steps_done, "world_size": trainer.world_size,
                              "generation": trainer.generation, "joined": record is not None}
                    with open(os.path.join(out, f"final-{pid}.json.tmp"), "w") as f:
                        json.dump(result, f)
                    os.replace(os.path.join(out, f"final-{pid}.json.tmp"), os.path.join(out, f"final-{pid}.json"))
                    return result
                time.sleep(STEP_S)
                trainer.step(_loss, x, y)
                log.write(f"{time.time():.3f} {trainer.steps_done} {trainer.world_size} {trainer.generation} "
                          f"{len(trainer.recoveries)}\n")
            epoch, skip = epoch + 1, 0
    except RankExcludedError as error:
        with open(os.path.join(out, f"excluded-{pid}.txt"), "w") as f:
            f.write(str(error))
        raise


# ------------------------------------------------------------------ the driver (in the test process)

class _Hang(Exception):
    pass


class Soak:
    """The ranks' processes on the test hosts and the waits on what they report."""

    def __init__(self, hosts, etcd, tmp_path, seed):
        self.hosts, self.etcd, self.tmp = hosts, etcd, tmp_path
        self.out = tmp_path / "out"
        self.out.mkdir()
        self.url = etcd.url(f"soak-{os.getpid()}-{time.monotonic_ns()}")
        self.rng = random.Random(seed)
        self.slots = {}  # (host index, local rank) -> the process running there
        self.events = []  # the event log
        self.started = time.monotonic()

    # -- processes

    def start(self, slot):
        """Starts the rank of ``slot`` with the job's one command (the first start and every restart)."""
        host, local = slot
        rank = host * PER_HOST + local
        env = {"PYTHONPATH": os.pathsep.join([REPO, HERE] + sys.path), "TDX_TEST_PG_TIMEOUT": 600,
               "OMP_NUM_THREADS": 1, "TDX_STORE": self.url, "MASTER_ADDR": "hostA", "MASTER_PORT": 29999,
               "RANK": rank, "WORLD_SIZE": FULL, "LOCAL_RANK": local, "LOCAL_WORLD_SIZE": PER_HOST,
               "TDX_FAILURE_DETECTION_S": DETECTION_S}
        with open(self.tmp / f"rank{rank}.log", "a") as log:
            log.write(f"===== start at {time.time():.3f}\n")
            log.flush()
            self.slots[slot] = self.hosts.popen(host, [sys.executable, os.path.join(HERE, "_hostjob.py"), str(self.out),
                                                       "test_elastic_soak:_soak_job", str(self.out)], env=env, stdout=log,
                                                stderr=subprocess.STDOUT)

    def live(self):
        return {slot: p for slot, p in self.slots.items() if p.poll() is None}

    def steps(self, pid):
        """[(time, steps done, world size, generation, recoveries)] that process ``pid`` reported."""
        try:
            with open(self.out / f"steps-{pid}.txt") as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return []
        rows = []
        for line in lines:
            parts = line.split()
            if len(parts) == 5:
                rows.append((float(parts[0]),) + tuple(int(v) for v in parts[1:]))
        return rows

    # -- bounded waits

    def fail(self, what):
        raise _Hang(what)

    def wait_width(self, slots, width, since, what):
        """Waits until every process of ``slots`` reported a step at ``width`` completed after
        ``since`` (time.time()); returns the time when the last of them did."""
        deadline = time.monotonic() + WAIT_S
        while True:
            firsts = []
            for slot in slots:
                p = self.slots[slot]
                if p.poll() is not None:
                    self.fail(f"{what}: the rank of slot {slot} (pid {p.pid}) exited {p.returncode}")
                rows = [r for r in self.steps(p.pid) if r[0] > since and r[2] == width]
                firsts.append(rows[0][0] if rows else None)
            if all(t is not None for t in firsts):
                return max(firsts)
            if time.monotonic() > deadline:
                self.fail(f"{what}: not every rank trained at width {width} within {WAIT_S} s "
                          f"(first step at that width per slot: {dict(zip(slots, firsts))})")
            time.sleep(0.05)

    def wait_exit(self, slots, what, timeout=WAIT_S):
        """Waits until the processes of ``slots`` exited by themselves; returns their exit codes."""
        deadline = time.monotonic() + timeout
        for slot in slots:
            p = self.slots[slot]
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.fail(f"{what}: the rank of slot {slot} (pid {p.pid}) did not exit within {timeout} s")
        return [self.slots[s].returncode for s in slots]

    def log(self, text):
        line = f"[{time.monotonic() - self.started:8.2f} s] {text}"
        self.events.append(line)
        print(line, file=sys.stderr, flush=True)
        if os.environ.get("TDX_SOAK_LOG"):  # line by line: a run cut short keeps what it did
            with open(os.environ["TDX_SOAK_LOG"], "a") as f:
                f.write(line + "\n")

    # -- one event

    def event(self, n, kind):
        live = sorted(self.live())
        if len(live) != FULL:
            self.fail(f"event {n}: {len(live)} ranks live before it, not {FULL}")
        if kind in ("rank", "stop"):
            victims = [self.rng.choice(live)]
        else:
            host = self.rng.randrange(HOSTS)
            victims = [(host, i) for i in range(PER_HOST)]
        survivors = [s for s in live if s not in victims]
        pids = [self.slots[s].pid for s in victims]
        where = f"slots {victims} (pids {pids}, host {self.hosts.hosts[victims[0][0]].name})"
        at = time.time()
        if kind in ("rank", "host"):
            for s in victims:
                os.killpg(self.slots[s].pid, signal.SIGKILL)
        elif kind == "stop":
            os.kill(pids[0], signal.SIGSTOP)
        else:
            self.hosts.set_link(victims[0][0], False)
        shrunk = self.wait_width(survivors, FULL - len(victims), at, f"event {n} ({kind} {where})")
        if kind == "stop":
            os.kill(pids[0], signal.SIGCONT)
            codes = self.wait_exit(victims, f"event {n}: the continued rank")
            why = (self.out / f"excluded-{pids[0]}.txt")
            if codes != [1] or not why.exists():
                self.fail(f"event {n}: the continued rank exited {codes} without RankExcludedError")
            how = f"continued: exited with RankExcludedError ({why.read_text()[:90]}...)"
        elif kind == "cut":
            self.hosts.set_link(victims[0][0], True)
            codes = self.wait_exit(victims, f"event {n}: the cut-off ranks after the link came back")
            errors = [self.out / f"rank{h * PER_HOST + i}.err" for h, i in victims]
            last = [e.read_text().strip().splitlines()[-1][:110] if e.exists() else "no error" for e in errors]
            how = f"link restored: the cut-off ranks exited {codes} ({last[0]}...)"
        else:
            codes = self.wait_exit(victims, f"event {n}: the killed ranks")
            how = f"killed: exited {codes}"
        if kind == "cut" and any(c == 0 for c in codes):
            self.fail(f"event {n}: a cut-off rank exited 0 ({codes}) although the others went on without it")
        if kind == "cut":
            self.etcd.wait_healthy(self.etcd.members, timeout=WAIT_S)
        restart = time.time()
        for s in victims:
            self.start(s)
        full = self.wait_width(sorted(self.slots), FULL, restart, f"event {n}: after the restart of {victims}")
        self.log(f"event {n:3d} {kind:4s} {where}: fault -> survivors' step at {FULL - len(victims)} "
                 f"{shrunk - at:6.2f} s; {how}; restart -> all {FULL} training {full - restart:6.2f} s")

    # -- the end

    def finish(self):
        """Stops every rank at one step; returns their final records."""
        latest = max(r[1] for s, p in self.slots.items() for r in self.steps(p.pid)[-1:])
        stop = latest + STOP_MARGIN
        with open(self.out / "stop.tmp", "w") as f:
            f.write(str(stop))
        os.replace(self.out / "stop.tmp", self.out / "stop")
        codes = self.wait_exit(sorted(self.slots), "at the end")
        if codes != [0] * FULL:
            self.fail(f"at the end the ranks exited {codes}")
        finals = [json.loads((self.out / f"final-{p.pid}.json").read_text()) for p in self.slots.values()]
        return stop, finals

    def leftovers(self):
        """{host name: (pids other than the host's holder and etcd member, names in its /dev/shm)}."""
        etcd_pids = {p.pid for p in self.etcd.procs.values()}
        out = {}
        for h in self.hosts.hosts:
            pids = [pid for pid in _pids_in_netns(h.pid) if pid != h.pid and pid not in etcd_pids]
            out[h.name] = (pids, self.hosts.shm_files(h.index))
        return out

    def keys(self):
        """The job's keys in etcd that say where a recovery stands (shrinks, liveness), for a hang's report."""
        prefix = self.url.rsplit("/", 1)[1]
        for host in reversed(range(HOSTS)):  # the first that answers (a host may be cut off)
            try:
                keys = self.etcd.etcdctl(host, "get", "--prefix", "--keys-only", prefix).split()
                break
            except RuntimeError as e:
                keys = [f"etcdctl: {e}"]
        return "\n--- etcd keys ---\n" + "\n".join(k for k in keys if "/shrink" in k or "/alive/" in k or "etcdctl" in k) + "\n"

    def logs(self):
        files = sorted(glob.glob(str(self.tmp / "*.log"))) + sorted(glob.glob(str(self.out / "*.err")))
        return "\n".join(f"--- {p} ---\n{open(p).read()[-4000:]}" for p in files)


def _soak(hosts, etcd, tmp_path, kinds, seed):
    soak = Soak(hosts, etcd, tmp_path, seed)
    began = time.monotonic()
    try:
        for host in range(HOSTS):
            for local in range(PER_HOST):
                soak.start((host, local))
        soak.wait_width(sorted(soak.slots), FULL, 0, "the first start")
        soak.log(f"{FULL} ranks training (seed {seed}, events {list(kinds)})")
        for n, kind in enumerate(kinds):
            soak.event(n, kind)
        stop, finals = soak.finish()
    except _Hang as error:
        for p in soak.live().values():  # where each rank is (faulthandler, into its log)
            os.kill(p.pid, signal.SIGUSR1)
        time.sleep(2)
        soak.log(f"FAILED: {error}")
        pytest.fail(f"{error}\nevents:\n" + "\n".join(soak.events) + "\n" + soak.logs() + soak.keys() + etcd.logs())
    finally:
        for p in soak.slots.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
    assert {f["hash"] for f in finals} == {finals[0]["hash"]}, finals
    assert all(f["steps_done"] == stop and f["world_size"] == FULL for f in finals), finals
    left = soak.leftovers()
    assert all(not pids and not shm for pids, shm in left.values()), f"left on the hosts (pids, /dev/shm): {left}"
    soak.log(f"end: {len(kinds)} events, {FULL} ranks stopped at step {stop} with equal parameters "
             f"(generation {finals[0]['generation']}); no process and no /dev/shm entry left on any host; "
             f"wall {time.monotonic() - began:.1f} s")


def test_elastic_soak_events(cluster, tmp_path):  # noqa: F811
    """5 events: each kind once and one drawn, in a seeded order."""
    seed = int(os.environ.get("TDX_SOAK_SEED", "38"))
    rng = random.Random(seed)
    kinds = list(KINDS) + [rng.choice(KINDS)]
    rng.shuffle(kinds)
    if os.environ.get("TDX_SOAK_KINDS"):  # a given sequence (e.g. "host,cut"), to reproduce a failure
        kinds = os.environ["TDX_SOAK_KINDS"].split(",")
    hosts, etcd = cluster
    _soak(hosts, etcd, tmp_path, kinds, seed)


@pytest.mark.soak
def test_elastic_soak_long(cluster, tmp_path):  # noqa: F811
    """TDX_SOAK_EVENTS events (default 100), each kind drawn with the seeded RNG."""
    seed = int(os.environ.get("TDX_SOAK_SEED", "38"))
    rng = random.Random(seed)
    kinds = [rng.choice(KINDS) for _ in range(int(os.environ.get("TDX_SOAK_EVENTS", "100")))]
    hosts, etcd = cluster
    _soak(hosts, etcd, tmp_path, kinds, seed)
