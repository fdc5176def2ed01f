#include "collectives/reduce_kernels.h"

#include "kernels/compress_math.h"

#define TDX_FOLD_NS fold_generic
#include "collectives/reduce_fold.h"
#undef TDX_FOLD_NS

namespace tdx {

namespace fold_avx2 {  // reduce_kernels_avx2.cc
bool usable();
void reduceIntoImpl(void* out, const void* const* in, int n, size_t count, DataType dt, ReduceOp op);
void reduceScaledSumImpl(void* out, const void* const* in, int n, size_t count, DataType dt, double s);
}  // namespace fold_avx2

namespace fold_avx512 {  // reduce_kernels_avx512.cc: fp16 / bf16 SUM, AVG and scaled SUM only
bool usable();
bool foldHalf(void* out, const void* const* in, int n, size_t count, DataType dt, int mode, float scale);
}  // namespace fold_avx512

// One converter for the whole library: kernels/compress_math.h (its NaN rule: a NaN stays a quiet
// NaN with its sign and leading payload bits).
float halfToFloat(uint16_t h) { return kernels::halfToFloat(h); }
uint16_t floatToHalf(float f) { return kernels::floatToHalf(f); }
float bfloat16ToFloat(uint16_t b) { return kernels::bf16ToFloat(b); }
uint16_t floatToBfloat16(float f) { return kernels::floatToBf16(f); }

namespace {
const bool kUseAvx2 = fold_avx2::usable();
const bool kUseAvx512 = kUseAvx2 && fold_avx512::usable();

// bf16 only: its conversions are integer work that the wider vectors halve (1 MB all_reduce 131 us
// against 176-183 us); fp16 converts in one F16C instruction either way, and its 512-bit build was
// 3-5% slower at 256 KB-4 MB (alternating runs, docs/performance.md).
bool wideFold(DataType dt) { return dt == DataType::kBFloat16; }
}  // namespace

bool reduceKernelsUseAvx2() { return kUseAvx2; }

void reduceInto(void* out, const void* const* in, int n, size_t count, DataType dt, ReduceOp op) {
  if (kUseAvx512 && wideFold(dt) && (op == ReduceOp::kSum || op == ReduceOp::kAvg) && n >= 1) {
    fold_avx512::foldHalf(out, in, n, count, dt, op == ReduceOp::kAvg ? 1 : 0, 1.0f);
    return;
  }
  if (kUseAvx2) return fold_avx2::reduceIntoImpl(out, in, n, count, dt, op);
  fold_generic::reduceIntoImpl(out, in, n, count, dt, op);
}

void reduceScaledSumInto(void* out, const void* const* in, int n, size_t count, DataType dt, double s) {
  if (kUseAvx512 && wideFold(dt) && n >= 1) {
    fold_avx512::foldHalf(out, in, n, count, dt, 2, static_cast<float>(s));
    return;
  }
  if (kUseAvx2) return fold_avx2::reduceScaledSumImpl(out, in, n, count, dt, s);
  fold_generic::reduceScaledSumImpl(out, in, n, count, dt, s);
}

}  // namespace tdx
