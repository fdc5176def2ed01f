"""A real SLURM cluster on one Linux machine, for the SLURM tests (test infrastructure, not shipped).

The hosts are test hosts (tests/_testhosts.py) (network, UTS, IPC and mount namespaces with their
own hostnames, joined by a bridge). ``hostA`` is the head node: munged, MariaDB, slurmdbd and
slurmctld run there; every other host runs one slurmd and is a compute node of partition ``tdx``.
The daemons are Debian's (``slurmctld``, ``slurmd``, ``slurmdbd``, ``slurm-client``, ``munge``,
``mariadb-server``), run in the foreground as root with every file (configs, munge key and socket,
database, spool and state directories, logs) under one temporary directory; nothing in /etc is
used or changed.

    with SlurmCluster(nodes=2) as cluster:
        job = cluster.sbatch(["launch/slurm.sbatch", "examples/train_ddp.py"], cwd=repo)
        assert cluster.wait_job(job, timeout=600) == "COMPLETED"

:func:`unavailable_reason` says why a cluster cannot start here (not root, no namespaces, packages
missing and not installable); :func:`ensure_packages` installs the packages with apt-get when they
are missing. ``close()`` (also on errors during start) kills every daemon and job process, removes
the hosts (their /dev/shm goes with them) and the temporary directory.
"""
import os
import re
import shutil
import subprocess
import tempfile
import time

import _apt
from _testhosts import TestHosts
from _testhosts import unavailable_reason as hosts_unavailable_reason

__all__ = ["PACKAGES", "PINS", "SlurmCluster", "ensure_packages", "unavailable_reason"]

# Debian packages and the program each provides (checked on PATH and in /usr/sbin).
PACKAGES = {"slurmctld": "slurmctld", "slurmd": "slurmd", "slurmdbd": "slurmdbd", "slurm-client": "sbatch",
            "munge": "munged", "mariadb-server": "mariadbd"}
# The versions installed (Debian 12's series; apt takes the newest matching version, so security
# updates are taken and another SLURM series is not).
PINS = {"slurmctld": "22.05.*", "slurmd": "22.05.*", "slurmdbd": "22.05.*", "slurm-client": "22.05.*",
        "munge": "0.5.*", "mariadb-server": "1:10.11.*"}


def missing_packages():
    """The Debian packages of PACKAGES whose program is not installed."""
    return _apt.missing(PACKAGES)


def ensure_packages():
    """Installs the missing packages with apt-get (non-interactive); returns None or why it could not."""
    return _apt.ensure(PACKAGES, PINS, "SLURM packages")


def unavailable_reason(install=True):
    """None if a cluster can start here (installing the packages first when `install`), else why not."""
    reason = hosts_unavailable_reason()
    if reason:
        return f"a SLURM cluster needs test hosts: {reason}"
    if install:
        return ensure_packages()
    missing = missing_packages()
    return f"SLURM packages not installed: {', '.join(missing)}" if missing else None


_SLURM_CONF = """\
ClusterName=tdx
SlurmctldHost={head}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# A requeued job may start again cred_expire + 1 s after it ended (SLURM's default: 120 s).
AuthInfo=cred_expire=30
StateSaveLocation={dir}/ctld
SlurmdSpoolDir={dir}/slurmd-%n
SlurmctldPidFile={dir}/run/slurmctld.pid
SlurmdPidFile={dir}/run/slurmd-%n.pid
SlurmctldLogFile={dir}/log/slurmctld.log
SlurmdLogFile={dir}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
{accounting}
JobCompType=jobcomp/none
JobRequeue=1
ReturnToService=2
# A node whose slurmd stops answering is marked DOWN after SlurmdTimeout seconds.
SlurmdTimeout={slurmd_timeout}
MessageTimeout=10
KillWait=30
MinJobAge=600
InactiveLimit=0
NodeName={nodes} CPUs={cpus} RealMemory=4000 State=UNKNOWN
PartitionName=tdx Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""

_SLURMDBD_CONF = """\
AuthType=auth/munge
DbdHost={head}
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=3306
StorageUser=root
StorageLoc=slurm_acct_db
LogFile={dir}/log/slurmdbd.log
PidFile={dir}/run/slurmdbd.pid
DebugLevel=info
"""


class SlurmCluster:
    """A controller (and, with `accounting`, slurmdbd on MariaDB) plus `nodes` compute nodes.

    nodes: compute nodes (1-8), named hostB, hostC, ...; hostA is the head node.
    accounting: run MariaDB and slurmdbd (``sacct`` works; torchx's scheduler needs it).
    cpus: CPUs each node declares (a node runs this many tasks at once).
    start_timeout: seconds to wait for every node to be idle.

    ``start_seconds`` holds how long the start took. ``env`` is the environment a client command
    needs (``SLURM_CONF``); :meth:`run` and :meth:`popen` run commands on the head node with it.
    """

    def __init__(self, nodes=2, accounting=True, cpus=2, start_timeout=120, slurmd_timeout=30):
        if not 1 <= nodes <= 8:
            raise ValueError(f"SlurmCluster: nodes must be between 1 and 8, got {nodes}")
        reason = unavailable_reason(install=False)
        if reason:
            raise RuntimeError(reason)
        t0 = time.monotonic()
        self.accounting = accounting
        self.dir = tempfile.mkdtemp(prefix="tdx-slurm-")
        os.chmod(self.dir, 0o755)
        self.hosts = None
        self.daemons = {}
        try:
            self.hosts = TestHosts(nodes + 1)
            self.head = self.hosts.hosts[0].name
            self.nodes = [h.name for h in self.hosts.hosts[1:]]
            self.conf = os.path.join(self.dir, "etc", "slurm.conf")
            self.env = {"SLURM_CONF": self.conf}
            self._write_configs(cpus, slurmd_timeout)
            self._start_munge()
            if accounting:
                self._start_mariadb()
                self._start_daemon("slurmdbd", self.head, ["slurmdbd", "-D"])
                self._wait_for(lambda: self.run(["sacctmgr", "-n", "show", "cluster"], check=False).returncode == 0,
                               60, "slurmdbd to answer sacctmgr")
                self.run(["sacctmgr", "-i", "add", "cluster", "tdx"], check=False)
            self._start_daemon("slurmctld", self.head, ["slurmctld", "-D", "-i"])
            for n in self.nodes:
                self._start_daemon(f"slurmd-{n}", n, ["slurmd", "-D"])
            self.wait_idle(start_timeout)
        except BaseException:
            self.close()
            raise
        self.start_seconds = time.monotonic() - t0

    # ---------------------------------------------------------------- start

    def _write_configs(self, cpus, slurmd_timeout):
        for sub in ("etc", "munge", "ctld", "run", "log", "db", "jobs"):
            os.makedirs(os.path.join(self.dir, sub), mode=0o755, exist_ok=True)
        os.chmod(os.path.join(self.dir, "munge"), 0o755)
        self.munge_socket = "/run/munge/munge.socket.2"
        fields = dict(dir=self.dir, head=self.head, munge_socket=self.munge_socket, cpus=cpus,
                      nodes=",".join(self.nodes), slurmd_timeout=slurmd_timeout,
                      accounting=("AccountingStorageType=accounting_storage/slurmdbd\n"
                                  f"AccountingStorageHost={self.head}" if self.accounting
                                  else "AccountingStorageType=accounting_storage/none"))
        with open(self.conf, "w") as f:
            f.write(_SLURM_CONF.format(**fields))
        dbd = os.path.join(self.dir, "etc", "slurmdbd.conf")
        with open(dbd, "w") as f:
            f.write(_SLURMDBD_CONF.format(**fields))
        os.chmod(dbd, 0o600)
        key = os.path.join(self.dir, "munge", "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)

    def _log(self, name):
        return open(os.path.join(self.dir, "log", f"{name}.out"), "w")

    def _start_daemon(self, name, host, argv):
        with self._log(name) as log:
            p = self.hosts.popen(host, argv, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.daemons[name] = p
        return p

    def _start_munge(self):
        d = os.path.join(self.dir, "munge")
        # Every host sees this cluster's munge directory at munge's default place (in its own mount
        # namespace only), so every SLURM program, sacctmgr's slurmdbd connection included, finds it.
        os.makedirs("/run/munge", exist_ok=True)
        for h in self.hosts.hosts:
            self.hosts.run(h.index, ["mount", "--bind", d, "/run/munge"])
        self._start_daemon("munged", self.head,
                           ["munged", "-F", "--force", f"--socket={self.munge_socket}",
                            f"--key-file={d}/munge.key", f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log",
                            f"--seed-file={d}/munged.seed"])
        self._wait_for(lambda: os.path.exists(os.path.join(d, "munge.socket.2")), 30, "munged to open its socket")

    def _start_mariadb(self):
        db = os.path.join(self.dir, "db")
        base = ["--no-defaults", f"--datadir={db}", "--user=root"]
        proc = subprocess.run(["mariadb-install-db", *base, "--auth-root-authentication-method=normal",
                               "--skip-test-db"], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"SlurmCluster: mariadb-install-db failed: {proc.stdout[-500:]}{proc.stderr[-500:]}")
        self._start_daemon("mariadb", self.head,
                           ["mariadbd", *base, "--skip-grant-tables", "--bind-address=127.0.0.1", "--port=3306",
                            f"--socket={self.dir}/run/mysqld.sock", f"--pid-file={self.dir}/run/mysqld.pid",
                            "--innodb-buffer-pool-size=256M", "--innodb-lock-wait-timeout=900",
                            f"--log-error={self.dir}/log/mariadb.log"])
        self._wait_for(lambda: os.path.exists(f"{self.dir}/run/mysqld.sock"), 60, "MariaDB to open its socket")

    def _wait_for(self, ready, timeout, what):
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [n for n, p in self.daemons.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"SlurmCluster: {', '.join(dead)} exited while waiting for {what}:\n"
                                   + self.logs(dead))
            if time.monotonic() > deadline:
                raise RuntimeError(f"SlurmCluster: timed out after {timeout} s waiting for {what}:\n" + self.logs())
            time.sleep(0.5)

    def wait_idle(self, timeout=120):
        """Waits until every compute node is idle in sinfo."""
        self._wait_for(self._all_idle, timeout, "every node to be idle in sinfo")

    def _all_idle(self):
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout.split()
        states = dict(zip(out[0::2], out[1::2]))
        return all(states.get(n) == "idle" for n in self.nodes)

    # ---------------------------------------------------------------- use

    def run(self, argv, check=True, host=None, timeout=60, cwd=None, env=None):
        """Runs a client command (sinfo, scontrol, ...) on `host` (default: the head node).

        cwd: its working directory (default /); env: variables on top of this process's and ``env``.
        """
        h = self.hosts.host(host if host is not None else self.head)
        full = ["nsenter", "--target", str(h.pid), "--net", "--uts", "--ipc", "--mount", f"--wd={cwd or '/'}", "--",
                "env", *(f"{k}={v}" for k, v in {**self.env, **(env or {})}.items()), *argv]
        proc = subprocess.run(full, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise RuntimeError(f"SlurmCluster: `{' '.join(argv)}` failed ({proc.returncode}): "
                               f"{proc.stdout.strip()} {proc.stderr.strip()}")
        return proc

    def popen(self, argv, env=None, cwd=None, stdout=None, stderr=None, host=None):
        """Starts a command on `host` (default: the head node) with the cluster's client environment."""
        return self.hosts.popen(host if host is not None else self.head, argv, env={**self.env, **(env or {})},
                                cwd=cwd, stdout=stdout, stderr=stderr)

    def sbatch(self, argv, cwd, env=None):
        """Submits ``sbatch --parsable <argv>`` from `cwd` on the head node; returns the job id."""
        proc = self.run(["sbatch", "--parsable", *argv], cwd=cwd, env=env)
        return int(proc.stdout.strip().split(";")[0])

    def job(self, job_id):
        """``scontrol show job`` as a dict (empty once the controller has forgotten the job)."""
        proc = self.run(["scontrol", "show", "job", "-o", str(job_id)], check=False)
        return dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", proc.stdout)) if proc.returncode == 0 else {}

    def wait_job(self, job_id, timeout, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                                "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED")):
        """Waits until the job is in one of `states` and has no process left; returns the state.

        Raises TimeoutError (with the job and the daemon logs) past `timeout` seconds.
        """
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            state = info.get("JobState")
            if state in states:
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"SlurmCluster: job {job_id} still {state} after {timeout} s: {info}\n"
                                   + self.logs())
            time.sleep(1)

    def logs(self, names=None, tail=3000):
        """The tails of the daemons' log files (all, or those whose name starts with one of `names`)."""
        out = []
        logdir = os.path.join(self.dir, "log")
        for f in sorted(os.listdir(logdir)) if os.path.isdir(logdir) else []:
            if names is None or any(f.startswith(n) for n in names):
                with open(os.path.join(logdir, f), errors="replace") as fh:
                    text = fh.read()
                out.append(f"--- {f}\n{text[-tail:]}")
        return "\n".join(out)

    def kill_node(self, node):
        """Loses compute node `node` as a crash would: SIGKILL to its slurmd and every process of its jobs."""
        for pid, _ in self.processes(node):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        self.daemons.pop(f"slurmd-{node}", None)

    def start_slurmd(self, node):
        """Starts `node`'s slurmd again (after kill_node); SLURM returns the node to service when it registers."""
        self._start_daemon(f"slurmd-{node}", node, ["slurmd", "-D"])

    def processes(self, host):
        """(pid, command line) of every process running on `host` (in its network namespace)."""
        h = self.hosts.host(host)
        target = os.readlink(f"/proc/{h.pid}/ns/net")
        found = []
        for entry in os.listdir("/proc"):
            try:
                if entry.isdigit() and int(entry) != h.pid and os.readlink(f"/proc/{entry}/ns/net") == target:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                    found.append((int(entry), cmd))
            except OSError:
                pass
        return found

    # ---------------------------------------------------------------- teardown

    def close(self):
        """Kills every daemon and job process, removes the hosts and the temporary directory."""
        if self.hosts is not None:
            self.hosts.close()
            self.hosts = None
        self.daemons = {}
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
