"""torch's own distributed test suite (DistributedTest, shipped in the torch wheel) on backend BACKEND.

"tdx" is declared wherever torch's feature and skip tables list "gloo", and as an available plugin.
Tests that torch gates on the literal name "gloo" rather than on those tables run on tdx too where
they test a feature tdx provides (GLOO_NAMED below), so a test runs on tdx wherever it runs on gloo
except for the skips listed in docs/torch_suite.md. Needs the `expecttest` package (torch's test
utilities import it). Run from the repository root, one world size at a time, e.g.

    BACKEND=tdx WORLD_SIZE=2 TEMP_DIR=$(mktemp -d) PYTHONPATH=$PWD:tests/torch_suite \
        python -m pytest -q tests/torch_suite/tdx_suite.py -k all_gather

The ranks of each test are forked from the pytest process (torch's former
test_distributed_fork.py; about 1 s a test instead of about 15 s with a fresh interpreter per rank).
TDX_SUITE_START=spawn starts them as torch's test_distributed_spawn.py does.
tests/test_torch_suite.py runs the curated selection in CI.
"""
import functools
import os

import torch
import torch.distributed as dist
import torchdist_ext  # noqa: F401  registers "tdx" (also in spawned children, which import this module)
from torch.testing._internal import common_distributed as cd

for feature, backends in cd.DistTestCases.backend_feature.items():
    if "gloo" in backends:
        backends.add("tdx")
cd.DistTestCases.backend_feature["plugin"].add("tdx")  # available: require_backend_is_available
for name, backends in cd.DistTestCases.skip_collective.items():
    if "gloo" in backends:
        backends.add("tdx")

from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed import distributed_test  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402

# Tests torch skips on every backend but the one named "gloo" (a literal in their decorators, not
# the feature tables) whose feature tdx provides; each name maps to the skip reason torch gives.
# torch's decorators only mark the test function (__unittest_skip__), so the test runs unchanged
# once the mark is lifted; skips the test keeps for other reasons (world size) still apply.
_GET_FUTURE = "get_future is only supported on mpi, nccl and gloo"
_COALESCED = "Test requires backend tdx to be one of {'gloo'}"
GLOO_NAMED = {
    "test_get_future": _GET_FUTURE,
    "test_accumulate_gradients_no_sync": _GET_FUTURE,
    "test_accumulate_gradients_no_sync_allreduce_hook": _GET_FUTURE,
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook": _GET_FUTURE,
    "test_accumulate_gradients_no_sync_grad_is_view": _GET_FUTURE,
    **{
        f"test_all_reduce_coalesced_{group}{op}": _COALESCED
        for group in ("", "full_group_", "group_")
        for op in ("sum", "product", "min", "max")
    },
    "test_grads_same_across_ranks_with_no_sync": _COALESCED,
    "test_scatter_object_list": _COALESCED,
    "test_barrier_timeout_full_group": "Only gloo backend supports timeouts",
    "test_batch_isend_irecv_gloo": "GLOO Batch Send Recv CPU",
    "test_batch_isend_irecv_gloo_tags": "GLOO Batch Send Recv CPU",
}


# Of those, the tests whose body picks its CPU path with `if BACKEND == "gloo"` (else it prepares
# no model): their body runs with distributed_test.BACKEND reading "gloo"; the process group they
# use is tdx's, created before the body runs, and the body creates no group of its own.
BODY_ASKS_GLOO = {
    "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_accumulate_gradients_no_sync_grad_is_view",
}


def _run_as_on_gloo(test, body_asks_gloo):
    """``test`` without torch's gloo-only skip mark (the mark sits on the function object)."""

    @functools.wraps(test)
    def run(self):
        if not body_asks_gloo:
            return test(self)
        if dist.get_backend() != "tdx":
            raise RuntimeError(f"tdx_suite: {test.__name__} runs on {dist.get_backend()}, not tdx")
        saved, distributed_test.BACKEND = distributed_test.BACKEND, "gloo"
        try:
            return test(self)
        finally:
            distributed_test.BACKEND = saved

    run.__unittest_skip__ = False  # functools.wraps copied the mark
    del run.__unittest_skip_why__
    return run


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        if os.environ.get("TDX_SUITE_START", "fork") == "spawn":
            self._spawn_processes()
        else:
            self._start_processes(torch.multiprocessing.get_context("fork").Process)


if os.environ.get("BACKEND") == "tdx":
    for _name, _reason in GLOO_NAMED.items():
        _test = getattr(TestDistBackendWithSpawn, _name)
        if getattr(_test, "__unittest_skip_why__", None) != _reason:
            raise RuntimeError(
                f"tdx_suite: torch's {_name} is no longer skipped with {_reason!r} on tdx "
                f"(found {getattr(_test, '__unittest_skip_why__', None)!r}); update GLOO_NAMED"
            )
        setattr(TestDistBackendWithSpawn, _name, _run_as_on_gloo(_test, _name in BODY_ASKS_GLOO))


if __name__ == "__main__":
    run_tests()
