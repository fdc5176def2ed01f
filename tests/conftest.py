import glob
import os

import pytest


def _creator_alive(path):
    """Segments are named tdx-<creator pid>-<random>; is that process still running?"""
    try:
        pid = int(os.path.basename(path).split("-")[1])
    except (IndexError, ValueError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _tdx_segments():
    return sorted(glob.glob("/dev/shm/tdx-*"))


@pytest.fixture(scope="session", autouse=True)
def no_shm_segments_left():
    """After the whole suite, /dev/shm must hold no tdx segment created by it.

    Every rank this suite started has exited by then, so a segment of ours that is still there has
    a dead creator. Segments whose creator still runs belong to another job on the machine (for
    example a second test run) and are not counted.
    """
    before = set(_tdx_segments())
    yield
    left = [s for s in _tdx_segments() if s not in before and not _creator_alive(s)]
    assert not left, f"tdx segments left in /dev/shm after the test suite: {left}"
