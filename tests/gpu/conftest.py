"""GPU tests: collected by the normal suite, skipped (with the reason) where there is no GPU or
this build of tdx has no CUDA part. Run them with tests/gpu/run.sh on a GPU machine."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/ (for _dist)


def gpu_skip_reason():
    if not torch.cuda.is_available():
        return "no CUDA GPU on this machine (torch.cuda.is_available() is False); run tests/gpu/run.sh on one"
    import torchdist_ext.kernels as k

    if not k.built_with_cuda():
        return "this build of tdx has no CUDA part (built without nvcc/NCCL); rebuild with TDX_CUDA=1"
    return None


def pytest_collection_modifyitems(config, items):
    reason = gpu_skip_reason()
    if reason is None:
        return
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.skip(reason=reason))
