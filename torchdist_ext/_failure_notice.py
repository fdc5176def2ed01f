"""A failing rank tells its peers before it unwinds.

Installed when ``torchdist_ext`` is imported (``TDX_FAILURE_NOTICE=0`` turns it off). Each of these
marks this rank failed in the shared memory of every live tdx group of the process, so peers
blocked in a collective raise at once, naming the rank and the reason, instead of learning of it
only once the process has finished exiting:

- an uncaught exception (``sys.excepthook``, KeyboardInterrupt included): "raised Type: message";
- ``sys.exit`` with a non-zero status: "called sys.exit(3)", plus the exception being handled when
  it is called inside an ``except`` block (torch.multiprocessing's pattern);
- a catchable fatal signal whose disposition is the default (SIGTERM, SIGHUP, SIGQUIT, SIGABRT,
  SIGSEGV, SIGBUS, SIGFPE, SIGILL): "killed by signal SIGTERM", then the signal's default action;
- interpreter exit with a group still alive (``atexit``): "its process exited (interpreter
  shutdown with the group alive)".

A rank whose collective already failed keeps that earlier reason (it names the rank where the
failure began), so an error raised by a collective is never reported as this rank's own failure.
Exceptions that are caught mark nothing. Nothing runs per collective.
"""
import atexit
import os
import sys

from . import _C

_MAX_REASON = 400
_installed = False
failing = False  # this process raised uncaught or called sys.exit(non-zero): its exit is a failure


def _note(reason):
    """Marks this rank failed with ``reason`` in every live tdx group of the process."""
    try:
        _C.note_process_failure(reason[:_MAX_REASON])
    except Exception:  # noqa: BLE001 - the process is failing; never hide its own error
        pass


def _describe(exc):
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def install():
    """Installs the hooks once per process (a second call does nothing)."""
    global _installed
    if _installed or os.environ.get("TDX_FAILURE_NOTICE", "1") == "0":
        return
    _installed = True
    previous_hook = sys.excepthook

    def excepthook(exc_type, exc, tb):
        global failing
        failing = True
        _note(f"raised {_describe(exc) if exc is not None else exc_type.__name__}")
        previous_hook(exc_type, exc, tb)

    sys.excepthook = excepthook
    previous_exit = sys.exit

    def exit(status=None):  # noqa: A001 - replaces sys.exit
        if status not in (None, 0):
            global failing
            failing = True
            handling = sys.exc_info()[1]
            why = f"called sys.exit({status!r})"
            if handling is not None and not isinstance(handling, SystemExit):
                why += f" while handling {_describe(handling)}"
            _note(why)
        previous_exit(status)

    exit.__doc__ = previous_exit.__doc__
    sys.exit = exit
    atexit.register(_note, "its process exited (interpreter shutdown with the group alive)")
    _C.install_fatal_signal_handlers()
