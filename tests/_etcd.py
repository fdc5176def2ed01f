"""A 3-member etcd cluster on the test hosts (tests/_testhosts.py), one member per host.

``EtcdCluster(hosts, members=(0, 1, 2))`` starts Debian's ``etcd`` (etcd-server 3.4.23, Debian 12's;
installed with tests/_apt.py when missing) in each host's network namespace, with its data in a
temporary folder, waits until every member is healthy, and stops every member (SIGKILL, then waits for it) and
removes the data when closed, also when the test failed. ``unavailable_reason()`` says why a
cluster cannot run here (no etcd and no apt-get, no pyetcd client). The members listen on
``<host ip>:2379`` (clients) and ``:2380`` (peers); ``url(prefix)`` is the ``etcd://`` URL of
``torchdist_ext.etcd_store.EtcdStore`` over all of them.
"""
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time

import _apt

CLIENT_PORT, PEER_PORT = 2379, 2380


# Debian packages and the program each provides, and the versions installed (Debian 12's series).
PACKAGES = {"etcd-server": "etcd", "etcd-client": "etcdctl"}
PINS = {"etcd-server": "3.4.23*", "etcd-client": "3.4.23*"}


def unavailable_reason():
    """None when an etcd cluster can run on the test hosts, else a sentence saying why not."""
    try:
        import pyetcd  # noqa: F401
    except ImportError as e:
        return f"the etcd v3 client is missing ({e}); pip install -r requirements-dev.txt"
    return _apt.ensure(PACKAGES, PINS, "etcd packages")


class EtcdCluster:
    """See the module docstring. ``started_seconds``: from the first member's start to a healthy cluster."""

    def __init__(self, hosts, members=(0, 1, 2), heartbeat_ms=50, election_ms=500):
        self.hosts = hosts
        self.members = [hosts.host(m) for m in members]
        self.dir = tempfile.mkdtemp(prefix="tdx-etcd-")
        self.procs = {}
        token = f"tdx-{os.getpid()}-{time.monotonic_ns()}"
        cluster = ",".join(f"{h.name}=http://{h.ip}:{PEER_PORT}" for h in self.members)
        started = time.monotonic()
        try:
            for h in self.members:
                argv = ["etcd", "--name", h.name, "--data-dir", os.path.join(self.dir, h.name),
                        "--listen-client-urls", f"http://{h.ip}:{CLIENT_PORT},http://127.0.0.1:{CLIENT_PORT}",
                        "--advertise-client-urls", f"http://{h.ip}:{CLIENT_PORT}",
                        "--listen-peer-urls", f"http://{h.ip}:{PEER_PORT}",
                        "--initial-advertise-peer-urls", f"http://{h.ip}:{PEER_PORT}",
                        "--initial-cluster", cluster, "--initial-cluster-state", "new",
                        "--initial-cluster-token", token, "--heartbeat-interval", str(heartbeat_ms),
                        "--election-timeout", str(election_ms)]
                log = open(os.path.join(self.dir, f"{h.name}.log"), "w")
                self.procs[h.name] = hosts.popen(h.index, argv, stdout=log, stderr=subprocess.STDOUT)
                log.close()
            self.wait_healthy(self.members, timeout=60)
            self.started_seconds = time.monotonic() - started
        except BaseException:
            self.close()
            raise

    def endpoints(self, members=None):
        return ",".join(f"http://{h.ip}:{CLIENT_PORT}" for h in (members or self.members))

    def url(self, prefix):
        """``etcd://ipA:2379,ipB:2379,ipC:2379/<prefix>``: every member."""
        return "etcd://" + ",".join(f"{h.ip}:{CLIENT_PORT}" for h in self.members) + "/" + prefix

    def etcdctl(self, host, *args, members=None):
        """Runs ``etcdctl --endpoints=<members> args`` on ``host``; returns its stdout."""
        proc = self.hosts.run(host, ["etcdctl", f"--endpoints={self.endpoints(members)}",
                                     "--dial-timeout=2s", "--command-timeout=3s", *args], check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc.stdout

    def status(self, host, members=None):
        """{member host name: (member id, leader id)} as the members report it."""
        out = json.loads(self.etcdctl(host, "endpoint", "status", "-w", "json", members=members))
        by_ip = {h.ip: h.name for h in self.members}
        return {by_ip[s["Endpoint"].split("//")[1].split(":")[0]]: (s["Status"]["header"]["member_id"],
                                                                    s["Status"]["leader"]) for s in out}

    def leader(self, host, members=None):
        """The host name of the member that leads, as the members reachable from ``host`` say."""
        status = self.status(host, members)
        ids = {member_id: name for name, (member_id, _) in status.items()}
        leaders = {leader for _, leader in status.values()}
        if len(leaders) != 1 or next(iter(leaders)) not in ids:
            raise RuntimeError(f"etcd: the members disagree on the leader or have none: {status}")
        return ids[next(iter(leaders))]

    def move_leader(self, to):
        """Makes the member on host ``to`` the leader (etcdctl move-leader)."""
        status = self.status(to)
        target, leader_id = status[self.hosts.host(to).name][0], next(iter(status.values()))[1]
        if target != leader_id:
            leader = next(h for h in self.members if status[h.name][0] == leader_id)
            self.etcdctl(to, "move-leader", format(target, "x"), members=[leader])
        deadline = time.monotonic() + 30
        while self.leader(to) != self.hosts.host(to).name:
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd: the leader did not move to {to} within 30 s")
            time.sleep(0.1)

    def wait_healthy(self, members, timeout):
        deadline = time.monotonic() + timeout
        while True:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"etcd: members {dead} exited at start:\n{self.logs()}")
            proc = self.hosts.run(members[0].index, ["etcdctl", f"--endpoints={self.endpoints(members)}",
                                                     "--dial-timeout=1s", "endpoint", "health"], check=False)
            if proc.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd: the cluster was not healthy within {timeout} s: {proc.stderr.strip()}\n"
                                   f"{self.logs()}")
            time.sleep(0.1)

    def logs(self):
        out = []
        for h in self.members:
            path = os.path.join(self.dir, f"{h.name}.log")
            if os.path.exists(path):
                out.append(f"--- etcd on {h.name} ---\n{open(path).read()[-2000:]}")
        return "\n".join(out)

    def alive(self):
        """Names of the hosts whose member process still runs."""
        return [n for n, p in self.procs.items() if p.poll() is None]

    def close(self):
        """Stops every member (SIGKILL; waits for each) and removes the data folders."""
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, 9)
                except (ProcessLookupError, PermissionError):
                    p.kill()
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalEtcd:
    """One etcd member on 127.0.0.1 (Debian's etcd-server), data in a temporary folder; ``url``: the
    ``etcd://`` URL of an ``EtcdStore`` under ``prefix``."""

    def __init__(self, prefix="tdx-test"):
        self.dir = tempfile.mkdtemp(prefix="tdx-etcd-")
        client, peer = _free_port(), _free_port()
        self.url = f"etcd://127.0.0.1:{client}/" + prefix
        self.proc = subprocess.Popen(
            ["etcd", "--name", "m0", "--data-dir", os.path.join(self.dir, "m0"),
             "--listen-client-urls", f"http://127.0.0.1:{client}", "--advertise-client-urls", f"http://127.0.0.1:{client}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"m0=http://127.0.0.1:{peer}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import pyetcd  # the client, from requirements-dev.txt (unavailable_reason says when it is missing)

        deadline = time.monotonic() + 30
        while True:
            try:
                pyetcd.client(host="127.0.0.1", port=client).status()  # a client marks a refusing member failed
                return
            except Exception:  # noqa: BLE001 - not serving yet
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.close()
                    raise
                time.sleep(0.1)

    def close(self):
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
