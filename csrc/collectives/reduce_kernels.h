// Element-wise reductions over several inputs, in a fixed order, for every dtype and op.
#pragma once

#include <cstddef>
#include <cstdint>

#include "collectives/types.h"

namespace tdx {

// out[i] = in[0][i] op in[1][i] op ... op in[n-1][i], folded left to right so every rank that
// computes the same element gets the same bits. fp16/bf16 accumulate in fp32 and round once.
// AVG divides the sum by `n`. `out` may alias one of the inputs.
void reduceInto(void* out, const void* const* in, int n, size_t count, DataType dt, ReduceOp op);
// out[i] = s*in[0][i] + s*in[1][i] + ..., each product rounded to the dtype before it is added
// (the bits of multiplying every input by s first, then summing). Floating dtypes only.
void reduceScaledSumInto(void* out, const void* const* in, int n, size_t count, DataType dt, double s);

// Whether the folds run their AVX2 + F16C build (the CPU has both and TDX_REDUCE_ISA is not "generic").
bool reduceKernelsUseAvx2();

// fp16 / bf16 conversions (round to nearest even; a NaN stays a quiet NaN with its sign and leading
// payload bits): kernels/compress_math.h's, the one converter of the library.
float halfToFloat(uint16_t h);
uint16_t floatToHalf(float f);
float bfloat16ToFloat(uint16_t b);
uint16_t floatToBfloat16(float f);

}  // namespace tdx
