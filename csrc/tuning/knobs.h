// The knobs of plan() as this process's environment sets them (common/env.h), so the engines and
// `python -m torchdist_ext.bench plan` ask the planner with the same values.
#pragma once

#include <string>

#include "tuning/plan.h"

namespace tdx::tuning {

// Reads TDX_XHOST_ALGO, TDX_XHOST_COMPRESS, TDX_XHOST_CHUNK_BYTES, TDX_ONESHOT_BYTES,
// TDX_SINGLE_COPY_BYTES, TDX_SHM_STREAM, TDX_BUFFER_BYTES, TDX_SPIN_US and TDX_YIELD_US; throws
// tdx::Error on a bad value.
Knobs knobsFromEnv();

// The planner's names back to its types ("all_reduce", "float32", "sum" or "SUM"); throw tdx::Error
// listing the names there are.
Op parseOp(const std::string& name);
DataType parseDtype(const std::string& name);
ReduceOp parseRedop(const std::string& name);

}  // namespace tdx::tuning
