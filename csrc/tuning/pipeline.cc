#include "tuning/pipeline.h"

namespace tdx::tuning {

bool batchWeightGrads(int64_t inFeatures, int64_t outFeatures) {
  return inFeatures > 0 && outFeatures > 0 && inFeatures * outFeatures >= kBatchWeightGradsMinElems;
}

}  // namespace tdx::tuning
