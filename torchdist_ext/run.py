"""torchrun with per-rank log prefixes, log files by default, and a one-line report per failed rank.

    python -m torchdist_ext.run [torchrun options] script.py [script args]
    tdx-run [torchrun options] script.py [script args]         (console script, once installed)

Takes exactly torchrun's options (it is ``torch.distributed.run`` underneath) and changes three
defaults:

- Every worker's stdout and stderr go to the console *and* to files (``--tee 3``) unless
  ``--tee``/``--redirects`` is given; files live under ``--log-dir`` (default: a new
  ``tdx-logs-*`` directory under the system temp dir, printed at start).
- Console lines are prefixed with the worker's **global** rank, ``[rank3]:``, instead of torchrun's
  ``[default1]:`` (set ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` to choose another prefix;
  ``--local-ranks-filter 0`` shows only local rank 0 on the console, the files keep everything).
- When the job fails (after ``--max-restarts`` are used up), one line per failed rank says which
  rank, on which host, with which exit code or signal, and where its log and error file are, e.g.
  ``torchdist_ext.run: rank 1 (local rank 1 on host1, pid 4242) failed: killed by signal 9
  (SIGKILL); its output: /tmp/tdx-logs-x/.../attempt_0/1/stderr.log``. The exit status is 1.

``--keep-survivors`` (ours, before the script) lets the other workers go on when one fails, for
in-place recovery (``torchdist_ext.elastic``, ``examples/train_ddp.py --elastic``): torchrun's agent
otherwise stops every worker at the first failure. The failed workers are reported as they go; the
agent counts its workers as succeeded when at least one of them exited 0 (the survivors finished
the training; ``--max-restarts`` is then not used) and as failed, as usual, when every one of them
failed (on several nodes each agent judges its own workers). It changes how the agent polls its
workers (torch's ``SubprocessContext``), checked against this torch's internals at start. Inside a
SLURM batch job that lost its batch host (``sbatch --no-kill``: no job script is left to end the
job), an agent whose workers exited 0 then cancels the job (``scancel``; it ends CANCELLED,
``torchdist_ext.launch.end_slurm_job_without_batch_host``).

``--rdzv-backend=etcd-v3 --rdzv-endpoint=host1:2379,host2:2379,host3:2379`` keeps torchrun's
rendezvous and the agents' store in that etcd cluster (``torchdist_ext._etcd_rendezvous``), and the
workers' store too (it sets ``TDX_STORE`` for them, read by ``init_distributed``): no host is then
special, the one that started the job included, as long as a majority of the etcd members lives.
With ``--keep-survivors`` and ``--rdzv-backend=etcd-v3``, a host started again while its job still
trains (an elastic trainer with ``rejoin=True`` marked it running in the workers' store) does not
enter torchrun's rendezvous (the other agents would restart their workers for the newcomer): this
command starts ``--nproc-per-node`` workers itself, with ``TDX_STORE`` and torchrun's variables,
and their ``init_distributed`` joins the running job (docs/elastic.md, Rejoin). ``--join`` (ours)
asks for that path only: when no job runs under ``--rdzv-id`` the command exits 1 and starts
nothing, instead of entering the rendezvous (where it would start a new training under the old id);
launch/slurm.sbatch passes it for ``JOIN_JOB``.
``--exit-barrier-timeout S`` (ours) is how long an agent whose workers finished waits for the other
agents (torch's ``LocalElasticAgent`` waits 300 s and torchrun has no option for it): after a host
was lost, the survivors' agents wait that long for its agent before they exit. With ``etcd-v3`` it
defaults to ``TDX_FAILURE_DETECTION_S`` (no agent holds the store, so none must outlive the others).

With ``--max-restarts`` > 0 it also sets ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (unless set):
torchrun's agent otherwise keeps one store for every attempt, and a restarted worker may read the
rendezvous keys of the attempt before it (pytorch/pytorch#135712).
"""
import glob
import os
import signal
import socket
import sys
import tempfile

__all__ = ["cli", "exit_barrier_timeout", "failure_report", "join_running_job", "keep_survivors", "main"]

_PREFIX_TEMPLATE = "[rank${rank}]:"


def _describe(failure) -> str:
    if failure.exitcode < 0:
        return f"killed by signal {-failure.exitcode} ({failure.signal_name()})"
    return f"exit code {failure.exitcode}"


def _worker_log_dir(log_dir: str, failure) -> str:
    """torchrun's directory for this worker's files: <log_dir>/<run>_*/attempt_<n>/<local_rank>.

    The failure's error_file names it when the worker wrote one; a worker killed by a signal has
    none ("<N/A>"), so the newest attempt directory of that local rank is taken instead.
    """
    if failure.error_file and os.path.isabs(failure.error_file) and failure.error_file != os.devnull:
        return os.path.dirname(failure.error_file)
    if not log_dir:
        return ""
    candidates = glob.glob(os.path.join(glob.escape(log_dir), "*", "attempt_*", str(failure.local_rank)))
    return max(candidates, key=os.path.getmtime, default="")


def failure_report(failures, host: str, log_dir: str = "") -> str:
    """One line per failed rank: rank, local rank, host, pid, cause, log files, last error line.

    failures: ``{global_rank: torch.distributed.elastic.multiprocessing.errors.ProcessFailure}``,
    as carried by ``ChildFailedError.failures``. Ranks that torchrun itself stopped with SIGTERM
    because another rank failed come last and say so.
    """
    stopped = {r for r, f in failures.items() if f.exitcode == -signal.SIGTERM} if len(failures) > 1 else set()
    if stopped == set(failures):
        stopped = set()
    lines = []
    for rank, f in sorted(failures.items(), key=lambda rf: (rf[0] in stopped, rf[0])):
        wdir = _worker_log_dir(log_dir, f)
        logs = [os.path.join(wdir, n) for n in ("stderr.log", "stdout.log") if wdir and os.path.exists(os.path.join(wdir, n))]
        where = (f"its output: {', '.join(logs)}" if logs else
                 "its output went to the console only (pass --tee 3 or --redirects 3 with --log-dir to keep it)")
        if rank in stopped:
            cause = "stopped by torchrun (SIGTERM) after the failure above"
        else:
            cause = f"failed: {_describe(f)}"
        line = f"torchdist_ext.run: rank {rank} (local rank {f.local_rank} on {host}, pid {f.pid}) {cause}; {where}"
        error_file = os.path.join(wdir, "error.json") if wdir else ""
        if error_file and os.path.exists(error_file):
            line += f"; traceback in {error_file}"
        message = f.message if isinstance(f.message, str) else str(f.message)
        last = message.strip().splitlines()[-1] if message.strip() else ""
        if last and rank not in stopped and "To enable traceback" not in last and not last.startswith("Signal"):
            line += f"\n    {last}"
        lines.append(line)
    return "\n".join(lines)


def keep_survivors(host: str) -> None:
    """Makes torchrun's agent (in this process) keep polling the other workers when one fails.

    A failed worker is reported at once; when all are done, the failures are dropped if at least
    one worker exited 0, so the agent sees success. Raises
    RuntimeError when this torch's SubprocessContext lacks what this relies on.
    """
    from torch.distributed.elastic.multiprocessing import api

    ctx = api.SubprocessContext
    if not (callable(getattr(ctx, "_capture_process_failures", None)) and callable(getattr(ctx, "_poll", None))):
        raise RuntimeError("torchdist_ext.run --keep-survivors: this torch's SubprocessContext has no "
                           "_capture_process_failures/_poll (torch 2.13 has them); run without --keep-survivors")
    if getattr(ctx._poll, "_tdx_keeps_survivors", False):
        return
    torch_poll = ctx._poll

    def poll(self):
        done = set()
        self._capture_process_failures(done)
        self._running_local_ranks.difference_update(done)
        reported = self.__dict__.setdefault("_tdx_reported", set())
        for local_rank, f in sorted(self._failures.items()):
            if local_rank not in reported:
                reported.add(local_rank)
                print(f"torchdist_ext.run: local rank {local_rank} on {host} (pid {f.pid}) failed: {_describe(f)}; "
                      "the other workers go on (--keep-survivors)", file=sys.stderr, flush=True)
        if self._running_local_ranks:
            return None
        if self._failures and len(self._failures) < self.nprocs:
            survivors = self.nprocs - len(self._failures)
            print(f"torchdist_ext.run: {survivors} of {self.nprocs} workers on {host} finished after "
                  f"{len(self._failures)} failed (--keep-survivors)", file=sys.stderr, flush=True)
            self._failures.clear()
        return torch_poll(self)

    poll._tdx_keeps_survivors = True
    ctx._poll = poll


def exit_barrier_timeout(seconds: float) -> None:
    """Makes torchrun's agents (in this process) wait ``seconds`` in their exit barrier."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    if seconds <= 0:
        raise ValueError(f"torchdist_ext.run: --exit-barrier-timeout must be > 0 seconds, got {seconds}")
    torch_init = getattr(LocalElasticAgent.__init__, "_tdx_torch_init", LocalElasticAgent.__init__)

    def init(self, *args, **kwargs):
        torch_init(self, *args, **kwargs)
        self._exit_barrier_timeout = seconds

    init._tdx_torch_init = torch_init
    LocalElasticAgent.__init__ = init


def _running_job_store(url: str, max_restarts: int):
    """The attempt whose workers' store holds a job that runs with rejoin=True (marked running, a
    member alive), or None."""
    from .elastic._rejoin import job_running
    from .etcd_store import EtcdStore

    for attempt in range(max_restarts, -1, -1):
        store = EtcdStore(f"{url.rstrip('/')}/attempt{attempt}", timeout=30)
        if job_running(store):
            return attempt
    return None


def join_running_job(args, attempt: int) -> int:
    """Starts this host's workers as joiners of the running job (no torchrun rendezvous); returns
    0 when at least one of them exited 0 (the others are reported), else 1."""
    import subprocess

    from .launch import JOINER_ENV

    nproc = int(args.nproc_per_node)
    host = socket.gethostname()
    procs = []
    for local in range(nproc):
        # RANK and WORLD_SIZE are placeholders: init_distributed takes the joiner's from the job.
        env = dict(os.environ, RANK=str(local), WORLD_SIZE=str(nproc), LOCAL_RANK=str(local),
                   LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
                   TORCHELASTIC_RESTART_COUNT=str(attempt), **{JOINER_ENV: "1"})
        env.setdefault("OMP_NUM_THREADS", "1")
        argv = ([args.training_script] if args.no_python else
                [sys.executable, "-u"] + (["-m"] if args.module else []) + [args.training_script])
        procs.append(subprocess.Popen(argv + list(args.training_script_args), env=env))
    print(f"torchdist_ext.run: the job runs (its workers' store says so): {nproc} workers on {host} join it "
          "(--keep-survivors)", file=sys.stderr, flush=True)
    codes = [p.wait() for p in procs]
    for local, code in enumerate(codes):
        if code:
            print(f"torchdist_ext.run: joining worker {local} on {host} (pid {procs[local].pid}) failed: exit code "
                  f"{code}", file=sys.stderr, flush=True)
    return 0 if 0 in codes else 1


def main(argv=None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    parser = get_args_parser()
    parser.add_argument("--keep-survivors", action="store_true",
                        help="torchdist_ext: let the other workers go on when one fails (in-place recovery)")
    parser.add_argument("--exit-barrier-timeout", type=float, default=None,
                        help="torchdist_ext: seconds an agent whose workers finished waits for the other agents "
                             "(torch's default: 300)")
    parser.add_argument("--join", action="store_true",
                        help="torchdist_ext: only join the job running under --rdzv-id (with --keep-survivors and "
                             "--rdzv-backend=etcd-v3); exit 1, starting nothing, when none runs")
    args = parser.parse_args(argv if argv is not None else sys.argv[1:])
    if args.join and not (args.keep_survivors and args.rdzv_backend == "etcd-v3"):
        parser.error("--join joins a running elastic job through its workers' store in etcd: it needs "
                     f"--keep-survivors and --rdzv-backend=etcd-v3 (got --rdzv-backend={args.rdzv_backend}"
                     f"{'' if args.keep_survivors else ', no --keep-survivors'})")
    if args.keep_survivors:
        keep_survivors(socket.gethostname())
    if args.exit_barrier_timeout is None and args.rdzv_backend == "etcd-v3":  # no agent is special: no long wait
        from .elastic._liveness import detection_seconds

        args.exit_barrier_timeout = detection_seconds()
    if args.exit_barrier_timeout is not None:
        exit_barrier_timeout(args.exit_barrier_timeout)
    if args.rdzv_backend == "etcd-v3":
        from ._etcd_rendezvous import register, store_url

        register()
        os.environ.setdefault("TDX_STORE", store_url(args.rdzv_endpoint, args.rdzv_id, "workers"))
        if args.keep_survivors:
            attempt = _running_job_store(os.environ["TDX_STORE"], int(args.max_restarts))
            if attempt is not None:
                return join_running_job(args, attempt)
            if args.join:
                print(f"torchdist_ext.run --join: no job runs under --rdzv-id={args.rdzv_id} (its workers' store "
                      f"{os.environ['TDX_STORE']} has no running mark with a live member; a job marks it once its "
                      "elastic trainer with rejoin=True is built, e.g. examples/train_ddp.py --elastic): nothing "
                      "started", file=sys.stderr, flush=True)
                return 1
    if str(args.tee) == "0" and str(args.redirects) == "0":
        args.tee = "3"
    if not args.log_dir:
        args.log_dir = tempfile.mkdtemp(prefix="tdx-logs-")
    os.environ.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", _PREFIX_TEMPLATE)
    if int(args.max_restarts) > 0:
        # torchrun's agent keeps one TCPStore for all attempts, so a restarted worker can read the
        # keys of the previous attempt (pytorch/pytorch#135712): tdx then opens a dead rank's
        # segment, NCCL/Gloo connect to old addresses. Without sharing, each attempt's rank 0
        # serves a fresh store.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # Signals the agent will pass on to its workers (torchrun's --signals-to-handle, which
    # launch/slurm.sbatch extends with SLURM's warning signal SIGUSR1): ignored until torchrun
    # installs its handlers when it starts the workers, so an early warning does not end the agent.
    for name in str(args.signals_to_handle if hasattr(args, "signals_to_handle") else "").split(","):
        sig = getattr(signal, name.strip(), None)
        if sig in (signal.SIGUSR1, signal.SIGUSR2) and signal.getsignal(sig) == signal.SIG_DFL:
            signal.signal(sig, signal.SIG_IGN)
    print(f"torchdist_ext.run: per-rank logs under {args.log_dir}", file=sys.stderr, flush=True)
    try:
        run(args)
    except ChildFailedError as e:
        print(failure_report(e.failures, socket.gethostname(), args.log_dir), file=sys.stderr, flush=True)
        return 1
    except SignalException as e:
        # SLURM's scancel, time limit, requeue or warning signal (or a kill): the agent has passed the
        # signal on to the workers and waited for them to stop (they may checkpoint first).
        name = signal.Signals(e.sigval).name
        print(f"torchdist_ext.run: got {name} on {socket.gethostname()}; its workers were sent {name} and have "
              f"stopped; their output: {args.log_dir}", file=sys.stderr, flush=True)
        return 128 + int(e.sigval)
    if args.keep_survivors and os.environ.get("SLURM_JOB_ID"):
        from .launch import end_slurm_job_without_batch_host

        end_slurm_job_without_batch_host()
    return 0


def cli() -> None:
    """Console-script entry point (``tdx-run``)."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
