#include "backend/cuda_registry.h"

#include <optional>

namespace tdx {

namespace {

std::optional<CudaRegistration>& registry() {
  static std::optional<CudaRegistration> r;
  return r;
}

}  // namespace

bool registerCuda(CudaRegistration registration) {
  registry() = registration;
  return true;
}

const CudaRegistration* cudaRegistration() { return registry() ? &*registry() : nullptr; }

}  // namespace tdx
