// Registers csrc/cuda with the rest of tdx when the extension is loaded.
#include "cuda/cuda_entry.h"

namespace tdx {
namespace {

const bool registered = registerCuda(CudaRegistration{&gpuIdentity, &makeNcclEngine, &compressHalfCuda,
                                                      &decompressHalfCuda, &int8QuantizeCuda, &int8DequantizeCuda});

}  // namespace
}  // namespace tdx
