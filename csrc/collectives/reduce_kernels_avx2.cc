// The folds of reduce_fold.h built for AVX2 + F16C (GCC vectorizes the loops 8 floats wide; fp16 and
// bf16 SUM/AVG take reduce_fold.h's explicit AVX2 loop); reduce_kernels.cc calls them when the CPU
// has both and TDX_REDUCE_ISA is not "generic".
#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "collectives/types.h"
#include "common/env.h"
#include "common/logging.h"
#include "kernels/compress_math.h"

namespace tdx::fold_avx2 {
bool usable() {
  if (reduceIsaGeneric()) return false;
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();  // may run in a static initializer, before libgcc's own
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}
}  // namespace tdx::fold_avx2

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,f16c")

#define TDX_FOLD_NS fold_avx2
#define TDX_FOLD_F16C 1
#include "collectives/reduce_fold.h"
#undef TDX_FOLD_F16C
#undef TDX_FOLD_NS
#pragma GCC pop_options
#else
// Not x86: usable() is false and these are never called; they forward to the generic build.
namespace tdx {
namespace fold_generic {
void reduceIntoImpl(void* out, const void* const* in, int n, size_t count, DataType dt, ReduceOp op);
void reduceScaledSumImpl(void* out, const void* const* in, int n, size_t count, DataType dt, double s);
}  // namespace fold_generic
namespace fold_avx2 {
void reduceIntoImpl(void* out, const void* const* in, int n, size_t count, DataType dt, ReduceOp op) {
  fold_generic::reduceIntoImpl(out, in, n, count, dt, op);
}
void reduceScaledSumImpl(void* out, const void* const* in, int n, size_t count, DataType dt, double s) {
  fold_generic::reduceScaledSumImpl(out, in, n, count, dt, s);
}
}  // namespace fold_avx2
}  // namespace tdx
#endif
