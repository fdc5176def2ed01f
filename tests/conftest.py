import glob
import os

import pytest


def _tdx_segments():
    return sorted(glob.glob("/dev/shm/tdx-*"))


@pytest.fixture(scope="session", autouse=True)
def no_shm_segments_left():
    """After the whole suite, /dev/shm must hold no tdx segment created by it."""
    before = set(_tdx_segments())
    yield
    left = [s for s in _tdx_segments() if s not in before]
    assert not left, f"tdx segments left in /dev/shm after the test suite: {left}"
