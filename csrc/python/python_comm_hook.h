// A DDP communication hook written in Python, `hook(state, bucket) -> torch.futures.Future`,
// run by the C++ reducer: the bucket is torch's own c10d.GradBucket, so hooks written for
// torch's DDP (default_hooks, powerSGD_hook, ...) run unchanged.
#pragma once

#include <pybind11/pybind11.h>

#include "reducer/comm_hook.h"

namespace tdx {

std::shared_ptr<CommHook> makePythonCommHook(pybind11::object state, pybind11::object hook);

}  // namespace tdx
