// torchdist_ext's built-in C++ communication hooks (Python: torchdist_ext.comm_hooks).
// Bytes each rank puts on the wire per fp32 bucket of n elements (ws = world size):
//   allreduce   4n  (an all_reduce of the fp32 bucket; the default path without a hook)
//   fp16 / bf16 2n  (an all_reduce of the compressed bucket, summed by the backend in fp32,
//                    rounded once)
//   int8        n + 4*ceil(n/block)  (all_gather of int8 values + one fp32 scale per block;
//                    each rank receives (ws-1) times that and sums in fp32, in rank order)
//   topk        12k, k = max(1, ceil(ratio * n))  (all_gather of int64 indices + fp32 values;
//                    each rank receives (ws-1) times that)
// int8 and topk keep a per-bucket residual (error feedback): they compress c = g + r, send
// compress(c) and keep r = c - decompress(compress(c)), so what is not sent now is sent later.
// Compression applies to float32 buckets on CPU and, in a build with the CUDA kernels, on CUDA
// (same bits: the kernels share compress_math.h); other dtypes are all_reduced uncompressed.
#pragma once

#include "reducer/comm_hook.h"

#include <map>

namespace tdx {

struct BuiltinHookOptions {
  std::string kind = "allreduce";  // allreduce | fp16 | bf16 | int8 | topk
  int64_t int8Block = 256;         // elements per int8 scale
  double topkRatio = 0.01;         // fraction of each bucket's elements sent by topk
};

// Makes a built-in hook over `pg`; throws ValueError for an unknown kind or bad options.
std::shared_ptr<CommHook> makeBuiltinHook(c10::intrusive_ptr<c10d::ProcessGroup> pg, BuiltinHookOptions opts);

}  // namespace tdx
