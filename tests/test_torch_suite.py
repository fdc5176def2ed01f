"""torch's own distributed test suite (DistributedTest, in the torch wheel) on tdx, world sizes 2 and 3.

Runs tests/torch_suite/tdx_suite.py (tdx declared like gloo) in a child pytest, one world size at a
time; torch's harness starts the ranks itself, so this file does not use tests/_dist.py. From the
child's JUnit report it requires: no test fails, and every test that passes on gloo
(tests/torch_suite/gloo_passes.txt, recorded with the same torch) passes on tdx, except TDX_SKIPS.
Skips with a reason when `expecttest` (imported by torch's test utilities) is missing or torch is
not the version the gloo record was made with. See docs/torch_suite.md.

`python tests/test_torch_suite.py REPORT.xml` prints the tests that passed in a JUnit report (how
gloo_passes.txt is recorded).
"""
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SUITE = os.path.join(HERE, "torch_suite")
GLOO_PASSES = os.path.join(SUITE, "gloo_passes.txt")

# Tests that pass on gloo and do not pass on tdx, with the reason (docs/torch_suite.md).
TDX_SKIPS = {
    "test_ddp_logging_data_cpu": (
        "deselected: torch's DDP logger names the backend with ProcessGroup::getBackendName(), "
        "which is 'custom' for every backend registered through Backend.register_backend; "
        "torch offers a plugin no way to name itself there"
    ),
    "test_monitored_barrier_gloo": "torch's dist.monitored_barrier raises ValueError on any backend but gloo",
    "test_monitored_barrier_gloo_rank_0_timeout": "as test_monitored_barrier_gloo",
    "test_monitored_barrier_gloo_subgroup": "as test_monitored_barrier_gloo",
    "test_sparse_all_reduce_sum": "tdx reduces dense tensors only (a sparse tensor raises a clear error)",
}
DESELECTED = ("test_ddp_logging_data_cpu",)


def outcomes(report):
    """{test name: "passed" | "skipped: REASON" | "failed: MESSAGE"} from a JUnit XML report."""
    results = {}
    for case in ET.parse(report).iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed: " + (child.get("message") or "")[:300]
            elif child.tag == "skipped":
                outcome = "skipped: " + (child.get("message") or "")
        results[case.get("name")] = outcome
    return results


def gloo_passes():
    """(torch version, names) of gloo_passes.txt."""
    version, names = None, []
    with open(GLOO_PASSES) as f:
        for line in f:
            line = line.strip()
            if line.startswith("# torch "):
                version = line.split()[2]
            elif line and not line.startswith("#"):
                names.append(line)
    return version, names


@pytest.mark.parametrize("world_size", [2, 3])
def test_torch_distributed_suite_passes_on_tdx_where_it_passes_on_gloo(world_size, tmp_path):
    pytest.importorskip("expecttest", reason="torch's test utilities import expecttest: "
                        "pip install -r requirements-dev.txt")
    version, expected = gloo_passes()
    if torch.__version__.split("+")[0] != version:
        pytest.skip(f"gloo_passes.txt is recorded with torch {version}, this is torch {torch.__version__}; "
                    "record it again (command at its top)")
    report = tmp_path / "suite.xml"
    env = dict(os.environ, BACKEND="tdx", WORLD_SIZE=str(world_size), TEMP_DIR=str(tmp_path),
               DISTRIBUTED_TESTS_DEFAULT_TIMEOUT="120",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, SUITE, os.environ.get("PYTHONPATH")) if p))
    suite = os.path.join("tests", "torch_suite", "tdx_suite.py")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", suite, f"--junitxml={report}",
           *(f"--deselect={suite}::TestDistBackendWithSpawn::{name}" for name in DESELECTED)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    tail = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert report.exists(), f"the suite wrote no report (exit code {proc.returncode}):\n{tail}"
    results = outcomes(report)
    failed = {name: r for name, r in results.items() if r.startswith("failed")}
    assert not failed, f"torch's suite on tdx at world size {world_size}: {failed}\n{tail}"
    not_passed = {name: results.get(name, "not run") for name in expected
                  if name not in TDX_SKIPS and results.get(name) != "passed"}
    assert not not_passed, f"pass on gloo, not on tdx at world size {world_size}: {not_passed}"
    assert proc.returncode == 0, tail


if __name__ == "__main__":
    print(f"""# The tests of torch's DistributedTest that pass on gloo on a CPU-only machine, recorded with
# torch {torch.__version__.split("+")[0]}
# at world sizes 2 and 3 (the same tests at both) with:
#   BACKEND=gloo WORLD_SIZE=2 TEMP_DIR=$(mktemp -d) PYTHONPATH=$PWD:tests/torch_suite \\
#       python -m pytest -q tests/torch_suite/tdx_suite.py --junitxml=gloo.xml
#   python tests/test_torch_suite.py gloo.xml > tests/torch_suite/gloo_passes.txt
# tests/test_torch_suite.py requires each to pass on tdx too, except its TDX_SKIPS.""")
    for name, outcome in sorted(outcomes(sys.argv[1]).items()):
        if outcome == "passed":
            print(name)
