"""Several real hosts on one Linux machine, for tests and benchmarks of the multi-host path.

Each host is a set of Linux namespaces held open by one idle process: its own network namespace
(one interface, ``eth0``, joined to the other hosts through a bridge in a switch namespace), its own
hostname (UTS), its own IPC namespace, and its own mount namespace with a private tmpfs on
``/dev/shm`` and an ``/etc/hosts`` that resolves every test host's name. A process started on a
host (:meth:`TestHosts.popen`, :meth:`TestHosts.torchrun`) sees only that host: tdx finds its
peers by hostname, shared memory works only between ranks of the same host, and everything
between hosts crosses the veth links, which :meth:`TestHosts.shape` limits with ``tc ... tbf`` and
:meth:`TestHosts.set_link` can cut and restore. Needs root (or CAP_SYS_ADMIN and CAP_NET_ADMIN),
``unshare``, ``nsenter``, ``ip`` and ``tc``; :func:`unavailable_reason` says why not when they are
missing.

    with TestHosts(2, rate="1gbit") as hosts:
        procs = hosts.torchrun(["train.py"], nproc_per_node=2)
        assert hosts.wait(procs, timeout=300) == [0, 0]
"""
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

__all__ = ["TestHosts", "unavailable_reason"]

_TOOLS = ("unshare", "nsenter", "ip", "tc")


def _run(argv, check=True):
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if check and proc.returncode != 0:
        raise RuntimeError(f"test hosts: `{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def unavailable_reason():
    """None if test hosts can be made here, else a sentence saying why not."""
    if sys.platform != "linux":
        return f"test hosts need Linux namespaces (this is {sys.platform})"
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        return f"test hosts need {', '.join(missing)} (util-linux and iproute2) on PATH"
    try:
        probe = subprocess.run(["unshare", "--net", "--uts", "--ipc", "--mount", "true"], capture_output=True,
                               text=True, timeout=30)
    except OSError as e:
        return f"test hosts: unshare could not run: {e}"
    if probe.returncode != 0:
        return ("test hosts need root (or CAP_SYS_ADMIN and CAP_NET_ADMIN) to create network, UTS, IPC and "
                f"mount namespaces: unshare said {probe.stderr.strip()!r}")
    return None


class Host:
    """One test host: its name, address, and the pid of the process that holds its namespaces."""

    def __init__(self, index, name, ip, pid):
        self.index, self.name, self.ip, self.pid = index, name, ip, pid

    def __repr__(self):
        return f"Host({self.name!r}, {self.ip})"


class TestHosts:
    """``n`` hosts on this machine joined by a switch; see the module docstring.

    rate: None (unshaped veth links) or a tc rate such as "1gbit" or "10gbit" for every link, in
        both directions. Hosts are named hostA, hostB, ... with addresses 10.213.<net>.<i + 1>/24,
        where <net> is derived from this process's pid (several instances can run at once).
    """

    __test__ = False  # not a pytest test class
    _made = 0

    def __init__(self, n, rate=None, net=None):
        if n < 1 or n > 26:
            raise ValueError(f"TestHosts: n must be between 1 and 26, got {n}")
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        self.n = n
        TestHosts._made += 1  # instances of one process get their own addresses and link names
        self.net = net if net is not None else 16 + (os.getpid() + 53 * TestHosts._made) % 200
        self.tag = f"t{os.getpid() % 100000}x{TestHosts._made % 100}"
        self.dir = tempfile.mkdtemp(prefix="tdx-hosts-")
        self.hosts, self._holders, self._procs = [], [], []
        self.rate = None
        try:
            self._build()
            if rate:
                self.shape(rate)
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- construction and teardown

    def _holder(self, script, *args):
        """Starts an idle process in new namespaces; returns its pid once `script` has run."""
        ready = os.path.join(self.dir, f"ready-{len(self._holders)}")
        p = subprocess.Popen(
            ["unshare", "--net", "--uts", "--ipc", "--mount", "--propagation", "private", "--",
             "sh", "-c", f'{script} && touch "{ready}" && exec sleep 2147483647', "holder", *args],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        self._holders.append(p)
        deadline = time.monotonic() + 30
        while not os.path.exists(ready):
            if p.poll() is not None:
                raise RuntimeError(f"test hosts: a namespace holder exited: {p.stderr.read().decode().strip()}")
            if time.monotonic() > deadline:
                raise RuntimeError("test hosts: a namespace holder did not start within 30 s")
            time.sleep(0.01)
        return p.pid

    def _build(self):
        names = [f"host{chr(ord('A') + i)}" for i in range(self.n)]
        ips = [f"10.213.{self.net}.{i + 1}" for i in range(self.n)]
        hosts_file = os.path.join(self.dir, "hosts")
        with open(hosts_file, "w") as f:
            f.write("127.0.0.1 localhost\n::1 localhost\n")
            f.writelines(f"{ip} {name}\n" for ip, name in zip(ips, names))
        self._switch = self._holder("ip link set lo up")
        self._ns(self._switch, ["ip", "link", "add", "br0", "type", "bridge"])
        self._ns(self._switch, ["ip", "link", "set", "br0", "up"])
        boot = ('hostname "$1" && mount -t tmpfs -o mode=1777,size=50% tdxshm /dev/shm && '
                'mount --bind "$2" /etc/hosts && ip link set lo up')
        for i, (name, ip) in enumerate(zip(names, ips)):
            pid = self._holder(boot, name, hosts_file)
            host_if, switch_if = f"{self.tag}h{i}", f"{self.tag}s{i}"
            _run(["ip", "link", "add", host_if, "type", "veth", "peer", "name", switch_if])
            _run(["ip", "link", "set", host_if, "netns", str(pid)])
            _run(["ip", "link", "set", switch_if, "netns", str(self._switch)])
            self._ns(pid, ["ip", "link", "set", host_if, "name", "eth0"])
            self._ns(pid, ["ip", "addr", "add", f"{ip}/24", "dev", "eth0"])
            self._ns(pid, ["ip", "link", "set", "eth0", "up"])
            self._ns(self._switch, ["ip", "link", "set", switch_if, "master", "br0", "up"])
            self.hosts.append(Host(i, name, ip, pid))

    def kill(self, host=None):
        """SIGKILLs every process running on `host` (index or name; None: on every host); the hosts stay."""
        for h in self.hosts if host is None else [self.host(host)]:
            for pid in _pids_in_netns(h.pid):
                if pid != h.pid:
                    _kill(pid)
        procs = [p for p in self._procs if host is None or p.host is self.host(host)]
        for p in procs:
            _kill_group(p)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._procs = [p for p in self._procs if p not in procs]

    def close(self):
        """Kills every process started on the hosts, then the hosts themselves (their /dev/shm goes too)."""
        self.kill()
        for p in self._holders:
            _kill_group(p)
        for p in self._holders:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._procs, self._holders, self.hosts = [], [], []
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---------------------------------------------------------------- running things on a host

    @staticmethod
    def _ns(pid, argv, check=True):
        return _run(["nsenter", "--target", str(pid), "--net", "--uts", "--ipc", "--mount", "--", *argv], check)

    def run(self, host, argv, check=True):
        """Runs a short command on host `host` (index or name) and returns its CompletedProcess."""
        return self._ns(self.host(host).pid, argv, check)

    def popen(self, host, argv, env=None, stdout=None, stderr=None, cwd=None):
        """Starts `argv` on `host` (index or name) in its own process group; returns the Popen.

        env: extra environment variables (on top of this process's environment).
        """
        h = self.host(host)
        full_env = dict(os.environ)
        full_env.update({k: str(v) for k, v in (env or {}).items()})
        p = subprocess.Popen(["nsenter", "--target", str(h.pid), "--net", "--uts", "--ipc", "--mount", "--", *argv],
                             env=full_env, stdout=stdout, stderr=stderr, cwd=cwd, stdin=subprocess.DEVNULL,
                             start_new_session=True)
        p.host = h
        self._procs.append(p)
        return p

    def torchrun(self, script_argv, nproc_per_node=2, env=None, port=29400, log_dir=None, rdzv_timeout=120):
        """Starts ``torchrun --nnodes=n`` on every host (c10d rendezvous on hostA); returns one Popen per host.

        Each host's output goes to ``<log_dir>/<host name>.log`` (log_dir defaults to a folder of
        this instance). The rendezvous endpoint is hostA's name, resolved by every host.
        """
        log_dir = log_dir or self.dir
        run_id = f"{self.tag}-{time.monotonic_ns()}"
        procs = []
        for h in self.hosts:
            argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.n}",
                    f"--nproc-per-node={nproc_per_node}", "--rdzv-backend=c10d",
                    f"--rdzv-endpoint={self.hosts[0].name}:{port}", f"--rdzv-id={run_id}",
                    f"--rdzv-conf=timeout={rdzv_timeout}", "--max-restarts=0", *script_argv]
            log = open(os.path.join(log_dir, f"{h.name}.log"), "w")
            procs.append(self.popen(h.index, argv, env=env, stdout=log, stderr=subprocess.STDOUT))
            log.close()
        return procs

    @staticmethod
    def wait(procs, timeout):
        """Exit codes of `procs` (None for one still running at the deadline, which is then killed)."""
        deadline = time.monotonic() + timeout
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                _kill_group(p)
                codes.append(None)
        return codes

    def shm_files(self, host):
        """The names in `host`'s /dev/shm."""
        return sorted(self.run(host, ["ls", "-A", "/dev/shm"]).stdout.split())

    def host(self, host):
        if isinstance(host, Host):
            return host
        for h in self.hosts:
            if host in (h.index, h.name):
                return h
        raise ValueError(f"test hosts: no host {host!r}; the hosts are {[h.name for h in self.hosts]}")

    # ---------------------------------------------------------------- the links

    def _switch_if(self, h):
        return f"{self.tag}s{h.index}"

    def shape(self, rate):
        """Limits every host's link to `rate` (e.g. "1gbit") in both directions; None removes the limit."""
        for h in self.hosts:
            for pid, dev in ((h.pid, "eth0"), (self._switch, self._switch_if(h))):
                self._ns(pid, ["tc", "qdisc", "del", "dev", dev, "root"], check=False)
                if rate:
                    # burst: 2 ms at the rate (at least 64 KiB); queue up to 100 ms before dropping.
                    burst = max(64 << 10, _rate_bytes(rate) // 500)
                    self._ns(pid, ["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst",
                                   str(burst), "latency", "100ms"])
        self.rate = rate

    def set_link(self, host, up):
        """Cuts (up=False) or restores host `host`'s link at the switch, like pulling its cable."""
        h = self.host(host)
        self._ns(self._switch, ["ip", "link", "set", self._switch_if(h), "up" if up else "down"])
        if up:
            self._ns(self._switch, ["ip", "link", "set", self._switch_if(h), "master", "br0"])

    def link_rate_bytes(self):
        """The shaped link rate in bytes per second, or None when unshaped."""
        return _rate_bytes(self.rate) if self.rate else None


def _rate_bytes(rate):
    """tc rate text ("1gbit", "500mbit", "10gbit") -> bytes per second."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    text = rate.strip().lower()
    for suffix, scale in units.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * scale / 8)
    raise ValueError(f"test hosts: cannot read the rate {rate!r}; use e.g. 1gbit, 500mbit, 10gbit")


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_group(p):
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            _kill(p.pid)


def _pids_in_netns(holder_pid):
    """Every process in the network namespace of `holder_pid`."""
    try:
        target = os.readlink(f"/proc/{holder_pid}/ns/net")
    except OSError:
        return []
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.readlink(f"/proc/{entry}/ns/net") == target:
                    pids.append(int(entry))
            except OSError:
                pass
    return pids
