// Pipeline decisions (torchdist_ext/pipeline): whether a stage's linear layer batches its weight
// gradients over several micro-batches. Torch-free, like plan.h; bound as _C.tuning.
#pragma once

#include <cstdint>

namespace tdx::tuning {

// A linear layer batches its weight gradients (PipelineStage(batch_weight_grads=None), the
// default) when its weight has at least this many elements (512 x 512). Batching keeps each
// micro-batch's input and output gradient through a Python autograd Function and concatenates them
// for one product, about 25 us per layer and micro-batch on the 2-core VM; it saves a thin product
// and a full read-modify-write of .grad per micro-batch, which grow with the weight. One stage of
// 4 x Linear(w, w), 8 micro-batches of 8-64 rows, F then B each, CPU time per micro-batch / batched
// (docs/bench/pipeline-wgrad-threshold-2core.txt, two runs under load): w = 256: 0.80-0.91x,
// w = 384: 0.87-0.98x, w = 512: 1.01-1.17x at 8-16 rows, 0.94-1.14x at 32-64, w = 1024: 1.03-1.77x.
// The two-stage 1F1B of 8 x Linear(512), batch 128, gains 1.05-1.17x in step time from it
// (docs/bench/pipeline-2rank-2core.txt); the pipeline-zb model (Linear(256)) lost 0.83-0.88x.
inline constexpr int64_t kBatchWeightGradsMinElems = int64_t{1} << 18;

// Whether a linear layer of `inFeatures` -> `outFeatures` batches its weight gradients by default.
bool batchWeightGrads(int64_t inFeatures, int64_t outFeatures);

}  // namespace tdx::tuning
