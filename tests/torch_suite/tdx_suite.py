"""torch's own distributed test suite (DistributedTest, shipped in the torch wheel) on backend BACKEND.

"tdx" is declared wherever torch's feature and skip tables list "gloo", and as an available plugin,
so a test runs on tdx exactly where it runs on gloo. Needs the `expecttest` package (torch's test
utilities import it). Run from the repository root, one world size at a time, e.g.

    BACKEND=tdx WORLD_SIZE=2 TEMP_DIR=$(mktemp -d) PYTHONPATH=$PWD:tests/torch_suite \
        python -m pytest -q tests/torch_suite/tdx_suite.py -k all_gather

See docs/torch_suite.md for what has been run and what is not done.
"""
import os
import sys

import torch.distributed as dist
import torchdist_ext  # noqa: F401  registers "tdx" (also in the spawned children, which import this module)
from torch.testing._internal import common_distributed as cd

for feature, backends in cd.DistTestCases.backend_feature.items():
    if "gloo" in backends:
        backends.add("tdx")
cd.DistTestCases.backend_feature["plugin"].add("tdx")  # available: require_backend_is_available
for name, backends in cd.DistTestCases.skip_collective.items():
    if "gloo" in backends:
        backends.add("tdx")

from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._spawn_processes()


if __name__ == "__main__":
    run_tests()
