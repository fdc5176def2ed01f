"""scripts/setup.sh, run a second time on a built checkout, compiles nothing.

The README's two commands both call it (train.sh, then test.sh): the second call must find the
objects of the first (one object folder, build/temp, for pip's editable build and build_ext).
"""
import glob
import os
import subprocess
import sys

import pytest

import torchdist_ext

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module():
    found = glob.glob(os.path.join(REPO, "torchdist_ext", "_C*.so"))
    return found[0] if found else None


@pytest.mark.skipif(os.path.realpath(os.path.dirname(torchdist_ext.__file__)) != os.path.join(os.path.realpath(REPO), "torchdist_ext")
                    or _module() is None or not os.path.isfile(os.path.join(REPO, "build", "temp", "build.ninja")),
                    reason="torchdist_ext is not built in place in this checkout (scripts/setup.sh was not run here)")
def test_second_setup_compiles_nothing():
    objects = glob.glob(os.path.join(REPO, "build", "temp", "**", "*.o"), recursive=True)
    assert objects, "no object files under build/temp"
    before = {o: os.stat(o).st_mtime_ns for o in objects}
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", os.path.join(REPO, "scripts", "setup.sh")], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    recompiled = [o for o in objects if os.stat(o).st_mtime_ns != before[o]]
    assert not recompiled, f"setup.sh recompiled {len(recompiled)} unchanged files, e.g. {recompiled[:3]}"
    dry = subprocess.run([sys.executable, "-m", "ninja", "-C", os.path.join(REPO, "build", "temp"), "-n"],
                         capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stdout + dry.stderr
    assert "no work to do" in dry.stdout, f"ninja would still compile:\n{dry.stdout}"
