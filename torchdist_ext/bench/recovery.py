"""A whole host lost and coming back: ours against torchft and against torchrun restarting from a checkpoint.

    python -m torchdist_ext.bench recovery --rounds 1 --plot recovery.png
    python -m torchdist_ext.bench recovery --frameworks ours,torchrun --no-rejoin

Makes ``--hosts`` test hosts on this machine (``tests/_testhosts.py`` of a source checkout: network,
UTS, IPC and mount namespaces; root needed) and trains the same model on ``--nproc-per-node`` ranks a
host (examples/train_ddp.py's DigitsNet and digits data, SGD, a seeded batch per step and rank) with:

- ``ours``: ``torchdist_ext.run --keep-survivors`` on every host, the rendezvous and the store in a
  3-member etcd cluster (one member a host, ``tests/_etcd.py``), ElasticDDP;
- ``torchft``: one replica group a host (torchft's Manager, ProcessGroupGloo, DDP and optimizer
  wrappers, ``min_replica_size=1``), ``torchft_lighthouse`` on the first host; torchft runs from the
  Python of ``--torchft-python`` (a venv with ``pip install -r docs/bench/requirements-recovery.txt``);
- ``torchrun``: ``torchdist_ext.run --max-restarts=1 --nnodes=H-1:H`` (torchrun, c10d rendezvous on
  the first host) with our DDP and a checkpoint every ``--ckpt-every`` steps to resume from.

The same kill schedule for each: the ranks of the last host stop after step ``--kill-step``, then
every process of that host is SIGKILLed (etcd member included). Once the survivors have completed
``--rejoin-after`` steps after the kill, the same command is started again on that host (a
returning node), where each framework takes it back: torchft heals it from a live replica group,
torchrun restarts every worker from the checkpoint, ours admits it at a step boundary
(``torchdist_ext.run`` finds the job running in etcd and starts the worker, whose
``init_distributed`` joins through ``torchdist_ext.elastic.rejoin``; its ElasticDDP, built with
``rejoin=True`` like the members', receives the state from a live member).
``--detection-s`` is the failure-detection time of both ours (``TDX_FAILURE_DETECTION_S``) and
torchft (the lighthouse's heartbeat timeout).

Every rank logs each completed step (wall time, world size, global step). Reported per run: the time
from the SIGKILL to the survivors' next completed step (the slowest survivor host), the steps
redone (step indices completed again after the kill), the world size after the loss, and for a
returning node the time from its process start to its first step completed with the survivors (a step
they completed too, at the same world size; a node that trains only alone, after they finished, is
said so) and the world size then.
``--plot`` writes a PNG of step and world size over time (0 = the kill) for the first round.

A benchmark, not a test: it prints a table, asserts nothing on time. Raw outputs: docs/bench/recovery-*.txt.
"""
import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from ._common import print_command
from .hosts import checkout_test_module

__all__ = ["main", "parse_args", "commands", "recovery_metrics", "joiner_timeline"]

FRAMEWORKS = ("ours", "torchft", "torchrun")
WORKER = "torchdist_ext.bench._recovery_worker"
LIGHTHOUSE_PORT, RDZV_PORT, GROUP_PORT = 29510, 29400, 29520


def _checkout():
    """The folder that holds torchdist_ext/, examples/ and tests/ (a source checkout)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _torchft_python(args):
    """args.torchft_python if it imports torchft, else a SystemExit saying how to get one."""
    try:
        proc = subprocess.run([args.torchft_python, "-c", "import torch, importlib.metadata as m; import torchft; "
                               "print(f'torch {torch.__version__}, torchft {m.version(\"torchft\")}')"],
                              capture_output=True, text=True, timeout=120)
    except OSError as e:
        proc = subprocess.CompletedProcess([], 1, "", str(e))
    if proc.returncode != 0:
        raise SystemExit(f"bench recovery: torchft does not import with --torchft-python {args.torchft_python} "
                         f"({proc.stderr.strip()[-300:]}); make a venv with --system-site-packages and "
                         "`pip install -r docs/bench/requirements-recovery.txt` in it, or leave torchft out of --frameworks")
    return proc.stdout.strip()


# ---------------------------------------------------------------------------- the plan


def commands(args, framework, names, run_dir, etcd_endpoint=None, returning=False):
    """What to start for one run: ``[(host index, argv, env)]`` for every host (``returning``: only
    the victim host, started again). ``names``: the test hosts' names (the last is the victim)."""
    n_hosts, victim = len(names), names[-1]
    worker = ["--framework", framework, "--out", os.path.join(run_dir, "log"),
              "--examples", os.path.join(_checkout(), "examples"), "--steps", str(args.steps),
              "--kill-step", str(args.kill_step), "--victim", victim, "--step-sleep", str(args.step_sleep),
              "--batch", str(args.batch), "--pg-timeout", str(args.pg_timeout)]
    py = sys.executable
    base_env = {"PYTHONPATH": os.pathsep.join(p for p in [_checkout(), os.environ.get("PYTHONPATH", "")] if p),
                "OMP_NUM_THREADS": 1}
    if returning:
        base_env["TDX_BENCH_RETURNING"] = 1
    run_id = f"recovery{os.path.basename(run_dir)}"
    out = []
    for i, name in enumerate(names):
        if returning and name != victim:
            continue
        logs = ["--log-dir", os.path.join(run_dir, f"agent-{name}-{'r' if returning else 'a'}")]
        if framework == "ours":
            argv = [py, "-m", "torchdist_ext.run", "--keep-survivors", "--exit-barrier-timeout", "5",
                    f"--nnodes={n_hosts}", f"--nproc-per-node={args.nproc_per_node}", "--rdzv-backend=etcd-v3",
                    f"--rdzv-endpoint={etcd_endpoint}", f"--rdzv-id={run_id}", "--max-restarts=0", *logs,
                    "-m", WORKER, *worker]
            env = dict(base_env, TDX_FAILURE_DETECTION_S=args.detection_s)
        elif framework == "torchrun":
            argv = [py, "-m", "torchdist_ext.run", f"--nnodes={n_hosts - 1}:{n_hosts}",
                    f"--nproc-per-node={args.nproc_per_node}", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint={names[0]}:{RDZV_PORT}", f"--rdzv-id={run_id}",
                    f"--max-restarts={args.max_restarts}", *logs, "-m", WORKER, *worker,
                    "--ckpt", os.path.join(run_dir, "ckpt.pt"), "--ckpt-every", str(args.ckpt_every)]
            env = dict(base_env)
        elif framework == "torchft":
            argv = [args.torchft_python, "-m", WORKER, *worker,
                    "--lighthouse", f"http://{names[0]}:{LIGHTHOUSE_PORT}"]
            env = dict(base_env, RANK=0, WORLD_SIZE=1, MASTER_ADDR=name, MASTER_PORT=GROUP_PORT)
        else:
            raise ValueError(f"bench recovery: unknown framework {framework!r}; choose from {', '.join(FRAMEWORKS)}")
        out.append((i, argv, env))
    return out


def lighthouse_command(args):
    """torchft's lighthouse: quorum of at least one replica group, heartbeats timed out after --detection-s."""
    exe = os.path.join(os.path.dirname(args.torchft_python), "torchft_lighthouse")
    return [exe if os.path.exists(exe) else "torchft_lighthouse", "--min_replicas", "1",
            "--bind", f"[::]:{LIGHTHOUSE_PORT}", "--heartbeat_timeout_ms", str(int(args.detection_s * 1000))]


def plan(args):
    """The runs in order: ``[(round, framework)]``, the frameworks interleaved round by round."""
    return [(r, fw) for r in range(args.rounds) for fw in args.frameworks]


# ---------------------------------------------------------------------------- the figures


def read_events(log_dir):
    """Every event of every rank of a run, by time."""
    events = []
    for path in glob.glob(os.path.join(log_dir, "*.jsonl")):
        with open(path) as f:
            events.extend(json.loads(line) for line in f if line.strip())
    return sorted(events, key=lambda e: e["t"])


def _with_survivors(e, survivors):
    """Whether a returning node's step `e` was a step of the survivors too (they logged the same step
    index at the same world size), not one it took alone (e.g. after they finished)."""
    return any(s["step"] == e["step"] and s["ws"] == e["ws"] for s in survivors)


def recovery_metrics(events, victim, kill_t, rejoin_t=None):
    """Figures of one run from its events (see the module docstring); None where it did not happen.

    victim: the killed host's name; kill_t: the wall time of the SIGKILL; rejoin_t: the wall time the
    returning node's command was started (None: no returning node)."""
    steps = [e for e in events if e["event"] == "step"]
    survivors = [e for e in steps if e["host"] != victim]
    before = [e["step"] for e in survivors if e["t"] < kill_t]
    after = [e for e in survivors if e["t"] >= kill_t]
    firsts = {}
    for e in after:
        firsts.setdefault(e["host"], e)
    last_before = max(before) if before else 0
    m = {"kill_step": last_before, "recovery_s": None, "ws_before": None, "ws_after": None,
         "steps_redone": len({e["step"] for e in after if e["step"] <= last_before}),
         "final_step": max((e["step"] for e in steps), default=0), "rejoin_s": None, "ws_rejoined": None,
         "rejoin_full_s": None, "returned_alone": False}
    prior = [e for e in survivors if e["t"] < kill_t]
    if prior:
        m["ws_before"] = prior[-1]["ws"]
    if firsts:
        m["recovery_s"] = max(e["t"] for e in firsts.values()) - kill_t
        m["ws_after"] = min(e["ws"] for e in firsts.values())
    if rejoin_t is not None:
        back = [e for e in steps if e["host"] == victim and e["t"] >= rejoin_t]
        together = [e for e in back if _with_survivors(e, survivors)]
        m["returned_alone"] = bool(back) and not together
        back = together
        if back:
            m["rejoin_s"] = back[0]["t"] - rejoin_t
            m["ws_rejoined"] = back[0]["ws"]
            full = [e for e in back if e["ws"] >= (m["ws_before"] or 0)]
            if full:
                m["rejoin_full_s"] = full[0]["t"] - rejoin_t
    return m


def joiner_timeline(events, victim, rejoin_t):
    """Where ours' returning node spent its time, in seconds from its command's start: its worker
    process start, then from ``torchdist_ext.elastic.joined()`` (the worker logs it as ``joined``) its
    announcement, its admission and its group; and the members' admission (``trainer.rejoins``, logged
    as ``admission``). A sentence, or "" when no joiner was admitted."""
    back = [e for e in events if e["host"] == victim and e["t"] >= rejoin_t]
    start = next((e["t"] for e in back if e["event"] == "start"), None)
    joined = next((e for e in back if e["event"] == "joined"), None)
    admission = next((e for e in events if e["event"] == "admission" and e["host"] != victim), None)
    if joined is None or admission is None:
        return ""
    return (f"joiner from its command's start: process {_fmt(start and start - rejoin_t, ' s')}, announced "
            f"{joined['announce_t'] - rejoin_t:.2f} s, admitted {joined['admitted_t'] - rejoin_t:.2f} s, group "
            f"{joined['group_t'] - rejoin_t:.2f} s; members' admission at step {admission['step']}: "
            f"{admission['seconds']:.2f} s (re-form {admission['reform_seconds']:.2f} s, state "
            f"{admission['state_seconds']:.2f} s)")


def _fmt(x, unit=""):
    return "-" if x is None else (f"{x:.2f}{unit}" if isinstance(x, float) else f"{x}{unit}")


def table(results, args):
    """One row per run, then the median of each figure per framework over the rounds."""
    head = (f"{'framework':>9} {'round':>5} {'kill@':>5} {'kill->step s':>12} {'redone':>6} {'ws':>7} "
            f"{'return->step s':>14} {'ws back':>7} {'full width s':>12} {'final':>5}  note")
    lines = [head]
    for r in results:
        m = r["metrics"]
        ws = f"{_fmt(m['ws_before'])}->{_fmt(m['ws_after'])}"
        lines.append(f"{r['framework']:>9} {r['round']:>5} {_fmt(m['kill_step']):>5} {_fmt(m['recovery_s']):>12} "
                     f"{_fmt(m['steps_redone']):>6} {ws:>7} {_fmt(m['rejoin_s']):>14} {_fmt(m['ws_rejoined']):>7} "
                     f"{_fmt(m['rejoin_full_s']):>12} {_fmt(m['final_step']):>5}  {r['note']}"
                     + ("returning node: trained only alone (the survivors had finished)" if m["returned_alone"] else ""))
    lines.append("")
    lines.append("median over rounds (range):")
    for fw in args.frameworks:
        rows = [r["metrics"] for r in results if r["framework"] == fw]
        parts = []
        for key, label in (("recovery_s", "kill->next step"), ("rejoin_s", "return->first step"),
                           ("rejoin_full_s", "return->full width")):
            vals = [m[key] for m in rows if m[key] is not None]
            parts.append(f"{label} {statistics.median(vals):.2f} s ({min(vals):.2f}-{max(vals):.2f})" if vals
                         else f"{label} -")
        redone = [m["steps_redone"] for m in rows]
        parts.append(f"steps redone {max(redone) if redone else '-'} at most")
        lines.append(f"  {fw}: " + "; ".join(parts))
    return "\n".join(lines)


def plot(results, path):
    """Step and world size over time (0 = the kill) of each framework's first run, one column a
    framework, one line a process of each host (the killed / returning host dotted), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    firsts = {}
    for r in results:
        firsts.setdefault(r["framework"], r)
    fig, axes = plt.subplots(2, len(firsts), sharey="row", squeeze=False, figsize=(4.2 * len(firsts), 6))
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
    for col, r in enumerate(firsts.values()):
        ax_step, ax_ws, k = axes[0][col], axes[1][col], r["kill_t"]
        steps = [e for e in r["events"] if e["event"] == "step"]
        for i, host in enumerate(dict.fromkeys(sorted(e["host"] for e in steps))):
            style, label = (":" if host == r["victim"] else "-"), host
            ev = [e for e in steps if e["host"] == host]
            for pid in dict.fromkeys(e["pid"] for e in ev):  # one line a process: a restart is a new line
                mine = [e for e in ev if e["pid"] == pid]
                ax_step.plot([e["t"] - k for e in mine], [e["step"] for e in mine], style, color=colors[i % 6],
                             label=label)
                ax_ws.step([e["t"] - k for e in mine], [e["ws"] for e in mine], style, color=colors[i % 6],
                           where="post")
                label = None
        for ax in (ax_step, ax_ws):
            ax.axvline(0, color="red", linewidth=1)
            if r["rejoin_t"] is not None:
                ax.axvline(r["rejoin_t"] - k, color="black", linestyle="--", linewidth=0.8)
        m = r["metrics"]
        ax_step.set_title(f"{r['framework']}: next step {_fmt(m['recovery_s'], ' s')}, back {_fmt(m['rejoin_s'], ' s')}",
                          fontsize=9)
        ax_ws.set_xlabel("s since the SIGKILL")
        ax_step.legend(fontsize=7, loc="lower right")
    axes[0][0].set_ylabel("completed step")
    axes[1][0].set_ylabel("world size (ranks)")
    fig.suptitle(f"{r['victim']} SIGKILLed (red) and started again (dashed); dotted: that host's ranks", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------- one run


def _count(log_dir, kind):
    return sum(1 for e in read_events(log_dir) if e["event"] == kind)


def _wait(cond, timeout, what, procs, hosts_dir):
    deadline = time.monotonic() + timeout
    while not cond():
        dead = [p.returncode for p in procs if p.poll() not in (None, 0)]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"{what}: {'a process exited with ' + str(dead) if dead else f'not within {timeout} s'}"
                               f"\n{_tails(hosts_dir)}")
        time.sleep(0.02)


def _tails(run_dir):
    out = []
    for path in sorted(glob.glob(os.path.join(run_dir, "*.log"))):
        out.append(f"--- {os.path.basename(path)} ---\n{open(path, errors='replace').read()[-2500:]}")
    return "\n".join(out)


def run_once(args, framework, rnd, run_dir, testhosts, etcd_module):
    """One run of `framework`: start, kill the last host at --kill-step, maybe return it; its figures."""
    log_dir = os.path.join(run_dir, "log")
    os.makedirs(log_dir)
    note, services = "", []
    with testhosts.TestHosts(args.hosts) as hosts:
        names = [h.name for h in hosts.hosts]
        victim, etcd, endpoint = names[-1], None, None
        try:
            if framework == "ours":
                etcd = etcd_module.EtcdCluster(hosts, members=tuple(range(min(3, args.hosts))))
                endpoint = ",".join(f"{h.ip}:2379" for h in etcd.members)
            if framework == "torchft":
                with open(os.path.join(run_dir, "lighthouse.log"), "w") as log:
                    services.append(hosts.popen(0, lighthouse_command(args), stdout=log, stderr=subprocess.STDOUT))
                time.sleep(0.5)

            def start(returning=False):
                procs = []
                for i, argv, env in commands(args, framework, names, run_dir, endpoint, returning):
                    with open(os.path.join(run_dir, f"{names[i]}{'-returning' if returning else ''}.log"), "w") as log:
                        procs.append(hosts.popen(i, argv, env=env, stdout=log, stderr=subprocess.STDOUT))
                return procs

            procs = start()
            n = args.hosts * args.nproc_per_node
            _wait(lambda: _count(log_dir, "ready") >= n, args.timeout, f"{framework}: the {n} ranks did not start",
                  procs, run_dir)
            open(os.path.join(log_dir, "go"), "w").close()
            _wait(lambda: os.path.exists(os.path.join(log_dir, "at-kill")), args.timeout,
                  f"{framework}: step {args.kill_step} was not reached", procs, run_dir)
            time.sleep(0.05)  # every rank of the victim host has logged the step
            kill_t = time.time()
            hosts.kill(victim)
            survivors = procs[:-1]
            rejoin_t, back = None, []
            if args.rejoin_after:
                def survivors_went_on():
                    return sum(1 for e in read_events(log_dir) if e["event"] == "step" and e["host"] == names[0]
                               and e["t"] > kill_t) >= args.rejoin_after * args.nproc_per_node

                try:
                    _wait(survivors_went_on, args.timeout, f"{framework}: the survivors did not go on",
                          survivors, run_dir)
                    rejoin_t = time.time()
                    back = start(returning=True)
                except RuntimeError as e:
                    note = f"survivors did not go on: {str(e).splitlines()[0]}"
            codes = hosts.wait(survivors + back, timeout=args.timeout)
            if any(c != 0 for c in codes):
                note = (note + "; " if note else "") + f"exit codes {codes}"
                if args.verbose:
                    print(_tails(run_dir), file=sys.stderr)
        finally:
            for p in services:
                p.kill()
            if etcd is not None:
                etcd.close()
    events = read_events(log_dir)
    return {"framework": framework, "round": rnd, "kill_t": kill_t, "rejoin_t": rejoin_t, "victim": victim,
            "observer": names[0], "note": note, "events": events,
            "metrics": recovery_metrics(events, victim, kill_t, rejoin_t)}


# ---------------------------------------------------------------------------- the driver


def _parser():
    p = argparse.ArgumentParser(prog="python -m torchdist_ext.bench recovery", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS), help=f"comma list of {', '.join(FRAMEWORKS)}")
    p.add_argument("--hosts", type=int, default=3, help="test hosts (ours needs 3: an etcd member on each)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="ranks a host (torchft: 1, one replica group a host)")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps of a run")
    p.add_argument("--kill-step", type=int, default=30, help="the last host is killed after this step")
    p.add_argument("--rejoin-after", type=int, default=10,
                   help="the victim host's command starts again once the survivors completed this many steps "
                        "after the kill (0: no returning node)")
    p.add_argument("--no-rejoin", dest="rejoin_after", action="store_const", const=0, help="--rejoin-after 0")
    p.add_argument("--step-sleep", type=float, default=0.1,
                   help="seconds each rank sleeps after a step (paces the run so a returning node has steps to join)")
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--detection-s", type=float, default=5.0,
                   help="failure-detection time: TDX_FAILURE_DETECTION_S for ours, the lighthouse's heartbeat "
                        "timeout for torchft")
    p.add_argument("--ckpt-every", type=int, default=1, help="torchrun: checkpoint every this many steps")
    p.add_argument("--max-restarts", type=int, default=1, help="torchrun: --max-restarts")
    p.add_argument("--pg-timeout", type=float, default=120.0, help="process-group timeout of every framework")
    p.add_argument("--rounds", type=int, default=1, help="runs of each framework, interleaved")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds each phase of a run may take")
    p.add_argument("--torchft-python", default=sys.executable,
                   help="a Python that imports torchft (e.g. /work/venvs/torchft/bin/python)")
    p.add_argument("--plot", help="write a PNG of step and world size over time here")
    p.add_argument("--json", help="write every event and figure here")
    p.add_argument("--verbose", action="store_true", help="print the hosts' logs of a run that failed")
    p.add_argument("--keep", action="store_true", help="keep every run's logs (the folder is printed)")
    return p


def parse_args(argv=None):
    """The options, checked: a SystemExit names what is wrong."""
    args = _parser().parse_args(argv)
    args.frameworks = [f for f in args.frameworks.split(",") if f]
    bad = [f for f in args.frameworks if f not in FRAMEWORKS]
    problems = []
    if bad or not args.frameworks:
        problems.append(f"--frameworks {','.join(args.frameworks)}: choose from {', '.join(FRAMEWORKS)}")
    if "ours" in args.frameworks and args.hosts < 3:
        problems.append(f"--hosts {args.hosts}: ours needs 3 (a 3-member etcd cluster, one member a host)")
    if args.hosts < 2:
        problems.append(f"--hosts {args.hosts}: one host is killed, at least one must survive")
    if "torchft" in args.frameworks and args.nproc_per_node != 1:
        problems.append(f"--nproc-per-node {args.nproc_per_node}: torchft runs one replica group a host here "
                        "and its DDP wrapper averages across groups only; use 1")
    if args.nproc_per_node < 1 or args.rounds < 1 or args.steps < 1:
        problems.append(f"--nproc-per-node {args.nproc_per_node}, --rounds {args.rounds}, --steps {args.steps}: "
                        "each must be at least 1")
    if not 0 < args.kill_step < args.steps:
        problems.append(f"--kill-step {args.kill_step}: must be between 1 and --steps - 1 ({args.steps - 1})")
    if args.rejoin_after < 0 or args.kill_step + args.rejoin_after >= args.steps:
        problems.append(f"--rejoin-after {args.rejoin_after}: the survivors must still have steps left after "
                        f"--kill-step {args.kill_step} + it (--steps {args.steps})")
    if args.ckpt_every < 1 or args.detection_s <= 0:
        problems.append(f"--ckpt-every {args.ckpt_every}, --detection-s {args.detection_s}: must be positive")
    if problems:
        raise SystemExit("bench recovery: " + "; ".join(problems))
    return args


def main(argv=None):
    args = parse_args(argv)
    testhosts = checkout_test_module("_testhosts", "recovery")
    reason = testhosts.unavailable_reason()
    if reason:
        raise SystemExit(f"bench recovery: {reason}")
    etcd_module = checkout_test_module("_etcd", "recovery")
    if "ours" in args.frameworks:
        reason = etcd_module.unavailable_reason()
        if reason:
            raise SystemExit(f"bench recovery: ours needs etcd: {reason}")
    print_command("recovery", argv)
    versions = ""
    if "torchft" in args.frameworks:
        versions = f"; torchft's Python: {_torchft_python(args)}"
    load = os.getloadavg()
    print(f"# {args.hosts} test hosts x {args.nproc_per_node} ranks; {os.cpu_count()} CPUs, load average "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at start{versions}", flush=True)
    results = []
    top = tempfile.mkdtemp(prefix="tdx-bench-recovery-")
    try:
        for rnd, fw in plan(args):
            run_dir = os.path.join(top, f"{fw}-{rnd}")
            os.makedirs(run_dir)
            try:
                results.append(run_once(args, fw, rnd, run_dir, testhosts, etcd_module))
            except RuntimeError as e:
                print(f"# {fw} round {rnd}: failed: {e}", flush=True)
                continue
            m = results[-1]["metrics"]
            said = ", ".join(f"{e['host']} {e['seconds']:.2f} s" for e in results[-1]["events"]
                             if e["event"] == "recovery")
            print(f"# {fw} round {rnd}: kill->next step {_fmt(m['recovery_s'], ' s')}, redone {m['steps_redone']}, "
                  f"return->first step {_fmt(m['rejoin_s'], ' s')} {results[-1]['note']}"
                  + (f" (ElasticDDP's recovery, from the error it caught: {said})" if said else ""), flush=True)
            if results[-1]["rejoin_t"] is not None and fw == "ours":
                timeline = joiner_timeline(results[-1]["events"], results[-1]["victim"], results[-1]["rejoin_t"])
                print(f"#   {timeline or 'no joiner admitted'}", flush=True)
    finally:
        if args.keep:
            print(f"# logs kept in {top}")
        else:
            shutil.rmtree(top, ignore_errors=True)
    load = os.getloadavg()
    print(f"# load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the end")
    print(table(results, args))
    if args.plot and results:
        plot(results, args.plot)
        print(f"# plot: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": results}, f)
    return results


if __name__ == "__main__":
    main()
