"""Debian packages for tests that start real services (etcd, SLURM): test infrastructure, not shipped.

``ensure(packages, pins)`` installs, with apt-get as root and non-interactively, the packages whose
program is missing, each at its pinned version (``pkg=<pin>``: apt takes the newest version matching
the pin, so security updates are taken and another series is not). It returns None when every
program is there afterwards, else a sentence saying why not.
"""
import os
import shutil
import subprocess

__all__ = ["ensure", "missing", "which"]

_SBIN = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")


def which(prog):
    """The path of `prog` on PATH or in the sbin/bin folders (daemons live in /usr/sbin), or None."""
    return shutil.which(prog) or next((os.path.join(d, prog) for d in _SBIN if os.path.exists(os.path.join(d, prog))),
                                      None)


def missing(packages):
    """The packages of `packages` ({Debian package: a program it provides}) whose program is not installed."""
    return [pkg for pkg, prog in packages.items() if which(prog) is None]


def ensure(packages, pins, what):
    """Installs the missing `packages` ({package: program}) at `pins` ({package: version pattern}).

    what: how to name the packages in the returned sentence (e.g. "SLURM packages").
    Returns None when every program is installed (now or before), else why not.
    """
    todo = missing(packages)
    if not todo:
        return None
    if os.geteuid() != 0:
        return f"{what} {', '.join(todo)} are not installed and installing them needs root"
    if shutil.which("apt-get") is None:
        return f"{what} {', '.join(todo)} are not installed and there is no apt-get to install them"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for argv in (["apt-get", "update", "-q"],
                 ["apt-get", "install", "-y", "-q", "--no-install-recommends", *(f"{p}={pins[p]}" for p in todo)]):
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
        if proc.returncode != 0:
            return f"`{' '.join(argv)}` failed: {proc.stderr.strip()[-500:]}"
    still = missing(packages)
    return f"apt-get installed but {', '.join(still)} still missing" if still else None
