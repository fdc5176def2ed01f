"""Reads the launch environment (torchrun or SLURM's srun) and initializes the process group.

A script written once runs unchanged under every launcher::

    import torchdist_ext

    env = torchdist_ext.init_distributed()      # backend "tdx" unless TDX_BACKEND or backend= says otherwise
    print(env.rank, env.world_size, env.local_rank, env.source)

Where the values come from, first match wins:

1. **torchrun** (also ``srun torchrun``, torchx, ``mp.spawn`` helpers that set the same
   variables): ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (all required), and
   ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` (default: ``RANK`` and ``WORLD_SIZE``, i.e. one host).
2. **srun alone** (one task per rank, no torchrun): ``SLURM_PROCID`` (rank), ``SLURM_NTASKS``
   (world size), ``SLURM_LOCALID`` (local rank), the tasks on this node from
   ``SLURM_TASKS_PER_NODE`` and ``SLURM_NODEID`` (or ``SLURM_NTASKS_PER_NODE``), and the rendezvous
   host: ``MASTER_ADDR`` if set, else the first host of ``SLURM_STEP_NODELIST`` /
   ``SLURM_NODELIST`` / ``SLURM_JOB_NODELIST`` (a compressed list such as ``node[01-04,07]``,
   expanded here without ``scontrol``). The port: ``MASTER_PORT`` if set, else
   ``20000 + SLURM_JOB_ID % 10000`` (the same on every task of a job, distinct between jobs).

Anything missing or malformed raises a ``ValueError`` naming the variables and what to do.

Preemption and time limits: :class:`PreemptionHandler` turns SLURM's warning signal (the one
``sbatch --signal=USR1@120`` asks for) and SIGTERM into one decision every rank takes at the same
step, and requeues the job (``scontrol requeue``) once the caller has written its checkpoint::

    stop = torchdist_ext.PreemptionHandler()          # before training; handlers for SIGUSR1 and SIGTERM
    for step, batch in enumerate(batches, start):
        if stop.should_stop():                         # collective: True on every rank or on none
            save_checkpoint(step)                      # rank 0, then a barrier
            stop.requeue()                             # rank 0: scontrol requeue $SLURM_JOB_ID (when it applies)
            sys.exit(stop.exit_code)
        train(batch)

The store: by default ``init_process_group``'s own (a ``TCPStore`` served by rank 0's process at
``MASTER_ADDR:MASTER_PORT``). With ``TDX_STORE=etcd://host1:2379,host2:2379,host3:2379/<job>``
the group's store is kept in that etcd cluster instead (``torchdist_ext.etcd_store.EtcdStore``), so
that losing any one host, rank 0's included, leaves the survivors a store; under torchrun the
attempt (``TORCHELASTIC_RESTART_COUNT``) is added to the prefix, so a restarted attempt never reads
its predecessor's keys.
"""
import os
import re
import shutil
import signal
import subprocess
import sys
import warnings
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import List, Mapping, Optional

JOINER_ENV = "TDX_JOIN_RUNNING_JOB"  # set by torchdist_ext.run on the workers it starts as joiners

__all__ = ["LaunchEnv", "PreemptionHandler", "end_slurm_job_without_batch_host", "init_distributed", "read_launch_env",
           "expand_slurm_nodelist", "slurm_port"]

_TORCHRUN_REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_SLURM_REQUIRED = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
_SLURM_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
_SLURM_PORT_BASE, _SLURM_PORT_SPAN = 20000, 10000
_HOW_TO_LAUNCH = (
    "Start the script with torchrun (e.g. `torchrun --standalone --nproc-per-node=2 script.py`), "
    "with `srun` inside a SLURM allocation, or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT yourself."
)


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits in the job, as read from the launcher's environment."""

    rank: int
    """Global rank, 0 <= rank < world_size."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int
    """Index of this process among the processes of its host (selects the GPU, if any)."""
    local_world_size: int
    """Number of processes on this host."""
    master_addr: str
    """Host serving the rendezvous store (rank 0's host)."""
    master_port: int
    """TCP port of the rendezvous store."""
    source: str
    """"torchrun" or "slurm": which launcher's variables were used."""


def _int_var(env: Mapping[str, str], name: str, minimum: int = 0) -> int:
    value = env[name]
    try:
        number = int(value.strip())
    except ValueError:
        raise ValueError(f"launch environment: {name}={value!r} is not an integer") from None
    if number < minimum:
        raise ValueError(f"launch environment: {name}={number} must be >= {minimum}")
    return number


def _check_ranks(env: LaunchEnv, names: str) -> LaunchEnv:
    if env.rank >= env.world_size:
        raise ValueError(f"launch environment: rank {env.rank} is not below world size {env.world_size} ({names})")
    if env.local_rank >= env.local_world_size:
        raise ValueError(f"launch environment: local rank {env.local_rank} is not below local world size "
                         f"{env.local_world_size} ({names})")
    if env.local_world_size > env.world_size:
        raise ValueError(f"launch environment: local world size {env.local_world_size} exceeds world size "
                         f"{env.world_size} ({names})")
    if not 0 < env.master_port < 65536:
        raise ValueError(f"launch environment: MASTER_PORT={env.master_port} is not a TCP port (1-65535)")
    if not env.master_addr:
        raise ValueError("launch environment: MASTER_ADDR is empty; set it to the host of rank 0")
    return env


def _expand_range(token: str, text: str) -> List[str]:
    """"01-04" -> ["01", "02", "03", "04"] (zero padding kept), "7" -> ["7"]."""
    m = re.fullmatch(r"(\d+)\s*(?:-\s*(\d+))?", token.strip())
    if not m:
        raise ValueError(f"SLURM nodelist {text!r}: {token!r} is not a number or a range like 01-04")
    lo, hi = m.group(1), m.group(2) if m.group(2) is not None else m.group(1)
    if int(hi) < int(lo):
        raise ValueError(f"SLURM nodelist {text!r}: range {token!r} runs backwards")
    width = len(lo) if lo.startswith("0") or len(lo) == len(hi) else 0
    return [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]


def _expand_host(pattern: str, text: str) -> List[str]:
    """One host pattern, possibly with several bracket groups: "rack[1-2]-n[01,03]" -> 4 names."""
    hosts = [""]
    pos = 0
    while pos < len(pattern):
        open_at = pattern.find("[", pos)
        if open_at < 0:
            literal, pos = pattern[pos:], len(pattern)
            choices = [literal]
        else:
            close_at = pattern.find("]", open_at)
            if close_at < 0:
                raise ValueError(f"SLURM nodelist {text!r}: '[' without a matching ']'")
            literal = pattern[pos:open_at]
            inner = pattern[open_at + 1:close_at]
            if "[" in inner:
                raise ValueError(f"SLURM nodelist {text!r}: nested '['")
            if not inner:
                raise ValueError(f"SLURM nodelist {text!r}: empty brackets '[]'")
            choices = [literal + n for part in inner.split(",") for n in _expand_range(part, text)]
            pos = close_at + 1
        if "]" in literal:
            raise ValueError(f"SLURM nodelist {text!r}: ']' without a matching '['")
        hosts = [h + c for h in hosts for c in choices]
    return hosts


def expand_slurm_nodelist(nodelist: str) -> List[str]:
    """Expands a SLURM hostlist expression into host names, in order.

    ``"node[01-03,07],login1"`` -> ``["node01", "node02", "node03", "node07", "login1"]``. Commas
    inside brackets separate ranges, commas outside separate hosts; zero padding is kept; several
    bracket groups in one name give their product (``"r[1-2]n[1-2]"`` -> r1n1, r1n2, r2n1, r2n2).
    Raises ``ValueError`` naming the offending part when the expression is malformed.
    """
    if not isinstance(nodelist, str):
        raise TypeError(f"expand_slurm_nodelist: expected a str, got {type(nodelist).__name__}")
    text = nodelist.strip()
    if not text:
        raise ValueError("SLURM nodelist is empty")
    hosts, depth, start = [], 0, 0
    for i, ch in enumerate(text + ","):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"SLURM nodelist {text!r}: ']' without a matching '['")
        elif ch == "," and depth == 0:
            part = text[start:i].strip()
            if not part:
                raise ValueError(f"SLURM nodelist {text!r}: empty host name between commas")
            hosts += _expand_host(part, text)
            start = i + 1
    if depth != 0:
        raise ValueError(f"SLURM nodelist {text!r}: '[' without a matching ']'")
    return hosts


def _tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """SLURM_TASKS_PER_NODE "2(x3),1" with node 3 -> 1 (node ids count through the groups)."""
    node = 0
    for part in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise ValueError(f"launch environment: SLURM_TASKS_PER_NODE={tasks_per_node!r} is malformed "
                             f"(expected e.g. '2(x3),1')")
        count, repeat = int(m.group(1)), int(m.group(2) or 1)
        if node_id < node + repeat:
            return count
        node += repeat
    raise ValueError(f"launch environment: SLURM_NODEID={node_id} is beyond the {node} nodes of "
                     f"SLURM_TASKS_PER_NODE={tasks_per_node!r}")


def slurm_port(job_id: str) -> int:
    """The rendezvous port derived from a SLURM job id: 20000 + id % 10000."""
    try:
        return _SLURM_PORT_BASE + int(job_id) % _SLURM_PORT_SPAN
    except ValueError:
        raise ValueError(f"launch environment: SLURM_JOB_ID={job_id!r} is not an integer; set MASTER_PORT") from None


def _from_torchrun(env: Mapping[str, str]) -> LaunchEnv:
    missing = [k for k in _TORCHRUN_REQUIRED if not env.get(k)]
    if missing:
        present = [k for k in _TORCHRUN_REQUIRED if env.get(k)]
        raise ValueError(f"launch environment: {', '.join(present)} set but {', '.join(missing)} missing. "
                         f"torchrun sets all of {', '.join(_TORCHRUN_REQUIRED)}; if you set them yourself, set "
                         f"every one (MASTER_ADDR/MASTER_PORT: host and free port of rank 0).")
    rank, world = _int_var(env, "RANK"), _int_var(env, "WORLD_SIZE", 1)
    has_local = [k for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE") if env.get(k)]
    if len(has_local) == 1:
        other = "LOCAL_WORLD_SIZE" if has_local[0] == "LOCAL_RANK" else "LOCAL_RANK"
        raise ValueError(f"launch environment: {has_local[0]} is set but {other} is missing; set both or neither "
                         f"(neither means one host: LOCAL_RANK=RANK, LOCAL_WORLD_SIZE=WORLD_SIZE)")
    local_rank = _int_var(env, "LOCAL_RANK") if has_local else rank
    local_world = _int_var(env, "LOCAL_WORLD_SIZE", 1) if has_local else world
    return _check_ranks(LaunchEnv(rank, world, local_rank, local_world, env["MASTER_ADDR"].strip(),
                                  _int_var(env, "MASTER_PORT", 1), "torchrun"),
                        "RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE")


def _from_slurm(env: Mapping[str, str]) -> LaunchEnv:
    missing = [k for k in _SLURM_REQUIRED if not env.get(k)]
    nodelist_var = next((k for k in _SLURM_NODELIST_VARS if env.get(k)), None)
    if not env.get("MASTER_ADDR") and nodelist_var is None:
        missing.append("SLURM_NODELIST (or MASTER_ADDR)")
    if not env.get("MASTER_PORT") and not env.get("SLURM_JOB_ID"):
        missing.append("SLURM_JOB_ID (or MASTER_PORT)")
    if missing:
        raise ValueError(f"launch environment: SLURM_PROCID is set (started by srun) but {', '.join(missing)} "
                         f"missing. srun sets them for every task; run the script with srun inside an "
                         f"allocation (sbatch/salloc), or use torchrun (see launch/slurm.sbatch).")
    rank, world = _int_var(env, "SLURM_PROCID"), _int_var(env, "SLURM_NTASKS", 1)
    local_rank = _int_var(env, "SLURM_LOCALID")
    if env.get("SLURM_TASKS_PER_NODE") and env.get("SLURM_NODEID"):
        local_world = _tasks_on_node(env["SLURM_TASKS_PER_NODE"], _int_var(env, "SLURM_NODEID"))
    elif env.get("SLURM_NTASKS_PER_NODE"):
        local_world = _int_var(env, "SLURM_NTASKS_PER_NODE", 1)
    else:
        raise ValueError("launch environment: cannot tell how many tasks run on this node: set by srun are "
                         "SLURM_TASKS_PER_NODE with SLURM_NODEID, or SLURM_NTASKS_PER_NODE; none is present. "
                         "Pass --ntasks-per-node to sbatch/srun.")
    if env.get("MASTER_ADDR"):
        addr = env["MASTER_ADDR"].strip()
    else:
        try:
            addr = expand_slurm_nodelist(env[nodelist_var])[0]
        except ValueError as e:
            raise ValueError(f"launch environment: {nodelist_var}: {e}") from None
    port = _int_var(env, "MASTER_PORT", 1) if env.get("MASTER_PORT") else slurm_port(env["SLURM_JOB_ID"])
    return _check_ranks(LaunchEnv(rank, world, local_rank, local_world, addr, port, "slurm"),
                        "SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_TASKS_PER_NODE")


def read_launch_env(environ: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    """Reads rank, sizes and rendezvous address from torchrun's or srun's variables (see module doc).

    environ: the variables to read (default ``os.environ``); nothing is modified.
    """
    env = os.environ if environ is None else environ
    # RANK/WORLD_SIZE mark torchrun (also under `srun torchrun`); MASTER_* alone may be the user's
    # choice of rendezvous for srun, so they do not.
    if env.get("RANK") or env.get("WORLD_SIZE"):
        return _from_torchrun(env)
    if env.get("SLURM_PROCID"):
        return _from_slurm(env)
    if env.get("MASTER_ADDR") or env.get("MASTER_PORT"):
        return _from_torchrun(env)
    raise ValueError("launch environment: none of RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torchrun) nor "
                     "SLURM_PROCID (srun) is set, so this process does not know its rank. " + _HOW_TO_LAUNCH)


def _warn_if_restarts_share_the_store(launch: LaunchEnv) -> None:
    """torchrun with --max-restarts > 0 and its default shared store: warn once, on rank 0."""
    if (launch.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0").strip() not in ("", "0")):
        warnings.warn("init_distributed: torchrun runs with --max-restarts > 0 and shares its TCPStore with "
                      "the workers, so restarted workers can read the previous attempt's rendezvous keys "
                      "(pytorch/pytorch#135712) and fail to connect. Set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
                      "for torchrun, or launch with `python -m torchdist_ext.run`, which does.", stacklevel=3)


def init_distributed(backend: Optional[str] = None, timeout: Optional[timedelta] = None,
                     environ: Optional[Mapping[str, str]] = None, **kwargs) -> LaunchEnv:
    """Initializes the default process group from the launcher's environment; returns a ``LaunchEnv``.

    Args:
        backend: process-group backend; default: ``TDX_BACKEND`` from the environment, else ``"tdx"``
            (any torch backend string works, e.g. ``"gloo"`` or ``"cpu:tdx,cuda:nccl"``).
        timeout: per-operation timeout of the group (torch's default when None).
        environ: variables to read instead of ``os.environ`` (for tests). When they come from SLURM,
            ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
            ``MASTER_PORT`` are exported to ``os.environ`` so that code which reads torchrun's
            variables keeps working.
        kwargs: passed on to ``torch.distributed.init_process_group`` (e.g. ``device_id``).

    Raises ``ValueError`` naming the missing or malformed variables, and ``RuntimeError`` when the
    default group already exists.
    """
    import torch.distributed as dist

    from ._backend import register

    register()  # "tdx" (a no-op after the package's import, which registers it too)

    if dist.is_initialized():
        raise RuntimeError("init_distributed: the default process group already exists; call "
                           "torch.distributed.destroy_process_group() first or use it as it is")
    for k in ("init_method", "store", "rank", "world_size"):
        if k in kwargs:
            raise TypeError(f"init_distributed: {k}= is taken from the launch environment; call "
                            f"torch.distributed.init_process_group directly to pass it yourself")
    launch = read_launch_env(environ)
    if backend is None:
        backend = (environ if environ is not None else os.environ).get("TDX_BACKEND") or "tdx"
    if launch.source == "slurm" or environ is not None:
        os.environ.update(RANK=str(launch.rank), WORLD_SIZE=str(launch.world_size),
                          LOCAL_RANK=str(launch.local_rank), LOCAL_WORLD_SIZE=str(launch.local_world_size),
                          MASTER_ADDR=launch.master_addr, MASTER_PORT=str(launch.master_port))
    if timeout is not None:
        kwargs["timeout"] = timeout
    store_url = (environ if environ is not None else os.environ).get("TDX_STORE", "").strip()
    if store_url:
        store = _etcd_store(store_url, environ, timeout)
        from .elastic._rejoin import job_running, rejoin

        if job_running(store):  # a restarted rank or host of an elastic job (rejoin=True): it joins
            record = rejoin(store, backend, timeout=kwargs.get("timeout", dist.default_pg_timeout))
            return replace(launch, rank=record["rank"], world_size=record["world_size"])
        if (environ if environ is not None else os.environ).get(JOINER_ENV) == "1":
            # Started by ``torchdist_ext.run`` to join a running job: its RANK and WORLD_SIZE are
            # placeholders, never a job of their own.
            raise RuntimeError(f"torchdist_ext.init_distributed: this worker was started to join the running job of "
                               f"{store_url}, but no member of it is alive any more (it ended, or failed whole) "
                               "before the worker got here. Run the command again: with no job running it starts "
                               "a new one through torchrun's rendezvous")
        dist.init_process_group(backend, store=store, rank=launch.rank, world_size=launch.world_size, **kwargs)
        return launch
    _warn_if_restarts_share_the_store(launch)
    dist.init_process_group(backend, init_method="env://", rank=launch.rank, world_size=launch.world_size, **kwargs)
    return launch


class PreemptionHandler:
    """Stops training at the same step on every rank when SLURM warns or terminates the job, and requeues it.

    SLURM sends the signal that ``sbatch --signal=[B:]SIG@SECONDS`` names that many seconds before a
    job's time limit, and SIGTERM (then SIGKILL after the cluster's ``KillWait``) when the limit is
    reached, on ``scancel``, on preemption and on ``scontrol requeue``. Creating the handler installs
    a handler for each of `signals` that only records the signal; :meth:`should_stop` is the
    collective that turns "some rank got a signal" into the same answer on every rank, so every rank
    finishes or abandons the same step. After the checkpoint, :meth:`requeue` (on one rank) puts the
    job back in the queue with ``scontrol requeue`` when that is what the signal calls for:

    - the warning signal (any of `signals` but SIGTERM): always (the job is about to hit its limit);
    - SIGTERM because the time limit was reached (``scontrol show job`` says ``Reason=TimeLimit``);
    - not on SIGTERM from ``scancel`` (the user wants it gone), nor when SLURM is already requeueing
      the job itself (``scontrol requeue``, preemption with ``PreemptMode=REQUEUE``: its restart count
      has gone up), nor outside a SLURM batch job.

    A requeued job starts again from its batch script, with ``SLURM_RESTART_COUNT`` set, and resumes
    from the checkpoint. Under torchrun, the agent must pass the warning signal on to its workers
    (``--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1,SIGUSR2``, which launch/slurm.sbatch
    sets); under ``srun`` alone every rank gets the signal from SLURM.

    Args:
        signals: the signals to act on (default SIGUSR1, SIGUSR2 and SIGTERM). Must be created in the
            main thread, before training starts (a signal that arrives earlier has its default action,
            which for SIGUSR1 ends the process).
        group: the process group :meth:`should_stop` reduces over (default: the default group).
    """

    __slots__ = ("signals", "group", "received", "stopped", "requeued", "_previous")

    def __init__(self, signals=(signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM), group=None):
        self.signals = tuple(signal.Signals(s) for s in signals)
        if not self.signals:
            raise ValueError("PreemptionHandler: signals is empty; pass e.g. (signal.SIGUSR1, signal.SIGTERM)")
        self.group = group
        self.received = None
        """The first signal this process got (a signal.Signals), or None."""
        self.stopped = None
        """After should_stop() returned True: the signal that stopped the job, as agreed by all ranks."""
        self.requeued = False
        self._previous = {s: signal.signal(s, self._record) for s in self.signals}

    def _record(self, signum, frame):
        if self.received is None:
            self.received = signal.Signals(signum)

    def restore(self) -> None:
        """Puts back the handlers that were installed before this one."""
        for s, previous in self._previous.items():
            signal.signal(s, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def should_stop(self) -> bool:
        """Collective over the group: True on every rank when any rank has received one of the signals.

        Call it at the same point of every step on every rank (one all_reduce of one number). The
        signal all ranks agree on (the warning signal if any rank got one, else SIGTERM) is kept in
        ``stopped``.
        """
        import torch
        import torch.distributed as dist

        if self.stopped is not None:
            return True
        code = 0 if self.received is None else (1 if self.received == signal.SIGTERM else 2 + int(self.received))
        flag = torch.tensor([code], dtype=torch.int64)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        code = int(flag.item())
        if code == 0:
            return False
        self.stopped = signal.SIGTERM if code == 1 else signal.Signals(code - 2)
        return True

    @property
    def exit_code(self) -> int:
        """The status to exit with after stopping: 128 + the signal, as if the signal had ended the process."""
        return 128 + int(self.stopped or self.received or signal.SIGTERM)

    def requeue(self, environ=None) -> bool:
        """Requeues this SLURM batch job if the stop calls for it (see the class doc); True if it did.

        Call it on one rank, after the checkpoint is complete on every rank: SLURM ends the job's
        processes right away. Says on stderr what it did and why.
        """
        env = os.environ if environ is None else environ
        why = self.stopped or self.received
        job = env.get("SLURM_JOB_ID")
        if why is None:
            raise RuntimeError("PreemptionHandler.requeue: no signal was received; call it after should_stop() "
                               "returned True")
        if not job:
            _say(f"got {why.name}; not in a SLURM job (no SLURM_JOB_ID), so nothing to requeue")
            return False
        if shutil.which("scontrol") is None:
            _say(f"got {why.name} in SLURM job {job} but scontrol is not on PATH; cannot requeue the job")
            return False
        if why == signal.SIGTERM:
            info = _slurm_job_info(job)
            restarts, current = info.get("Restarts", "0"), env.get("SLURM_RESTART_COUNT", "").strip() or "0"
            if restarts != current:
                _say(f"got SIGTERM: SLURM is requeueing job {job} itself (restart count {restarts})")
                return False
            if info.get("Reason") != "TimeLimit":
                _say(f"got SIGTERM in job {job} (state {info.get('JobState', '?')}, reason "
                     f"{info.get('Reason', '?')}): cancelled, not requeued")
                return False
        proc = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            _say(f"got {why.name} but `scontrol requeue {job}` failed: {(proc.stderr or proc.stdout).strip()} "
                 "(a job submitted with --no-requeue, or on a cluster with JobRequeue=0, cannot be requeued; "
                 "resubmit it to resume from the checkpoint)")
            return False
        _say(f"got {why.name}: requeued SLURM job {job}; it resumes from the checkpoint when it starts again")
        self.requeued = True
        return True


def end_slurm_job_without_batch_host(job_id: Optional[str] = None) -> bool:
    """Ends (``scancel``) the SLURM batch job ``job_id`` (default ``SLURM_JOB_ID``) when its batch host is
    no longer one of its nodes; returns whether it did.

    For a surviving node's launcher after its workers finished (``torchdist_ext.run --keep-survivors``
    calls it when they exited 0): with ``sbatch --no-kill`` SLURM drops a lost batch host from the job
    and kills the batch step, but the job stays RUNNING on the other nodes, with no job script left to
    end it, until its time limit. Nothing is done for a job whose batch host is still among its nodes
    (the job script ends the job as usual), for an interactive allocation (no batch host), or when
    ``scontrol`` cannot tell. The job ends CANCELLED (SLURM has no command that completes another
    job); this process ignores the SIGTERM that ``scancel`` sends to every process of the job.
    """
    job = job_id or os.environ.get("SLURM_JOB_ID")
    if not job or shutil.which("scontrol") is None or shutil.which("scancel") is None:
        return False
    info = _slurm_job_info(job)
    batch, nodelist = info.get("BatchHost"), info.get("NodeList")
    if info.get("BatchFlag") != "1" or not batch or not nodelist or nodelist == "(null)":
        return False
    if batch in expand_slurm_nodelist(nodelist):
        return False
    _say(f"SLURM job {job} lost its batch host {batch} (its nodes are now {nodelist}) and its workers here "
         "finished: no job script is left to end the job, so it is cancelled (scancel) to release its nodes")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        proc = subprocess.run(["scancel", str(job)], capture_output=True, text=True, timeout=60)
        failed = f"exit {proc.returncode}: {proc.stderr.strip()}" if proc.returncode != 0 else ""
    except (subprocess.TimeoutExpired, OSError) as e:
        failed = str(e)
    if failed:
        _say(f"scancel {job} failed ({failed}); the job holds its nodes until its time limit or a scancel")
        return False
    return True


def _say(message):
    print(f"torchdist_ext: {message}", file=sys.stderr, flush=True)


def _slurm_job_info(job_id):
    """``scontrol show job -o`` as a dict ({} when scontrol fails or does not answer within 60 s)."""
    try:
        proc = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True,
                              timeout=60)
    except (subprocess.TimeoutExpired, OSError):
        return {}
    if proc.returncode != 0:
        return {}
    return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", proc.stdout))


# The stores init_distributed made. A store written in Python must outlive every group over it:
# torch keeps only its C++ half, and a call into a store whose Python object is gone fails.
_STORES = []


def _etcd_store(url: str, environ: Optional[Mapping[str, str]], timeout: Optional[timedelta]):
    """The EtcdStore of TDX_STORE, its prefix extended by torchrun's attempt when there is one."""
    from .etcd_store import EtcdStore

    env = environ if environ is not None else os.environ
    attempt = env.get("TORCHELASTIC_RESTART_COUNT")
    if attempt:
        url = f"{url.rstrip('/')}/attempt{attempt}"
    store = EtcdStore(url, timeout=timeout)
    _STORES.append(store)
    return store
