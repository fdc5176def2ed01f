#include "backend/gloo_factory.h"

#include <c10/util/Exception.h>

#include <mutex>

namespace tdx {

namespace {

std::mutex& factoryMutex() {
  static std::mutex mu;
  return mu;
}

// Never destroyed: the registered factory may hold Python objects, which must not be released
// after the interpreter is gone.
GlooFactory& factorySlot() {
  static auto* slot = new GlooFactory();
  return *slot;
}

}  // namespace

void setGlooFactory(GlooFactory factory) {
  std::lock_guard<std::mutex> lock(factoryMutex());
  factorySlot() = std::move(factory);
}

GlooGroups makeGlooGroups(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                          std::chrono::milliseconds timeout, const std::vector<std::string>& nodeIds) {
  GlooFactory factory;
  {
    std::lock_guard<std::mutex> lock(factoryMutex());
    factory = factorySlot();
  }
  TORCH_CHECK(factory, "tdx: no factory for Gloo groups is registered, so the cross-host part of a group cannot be "
              "re-formed; import torchdist_ext (it registers one) before shrinking a group that spans hosts");
  return factory(store, rank, size, timeout, nodeIds);
}

}  // namespace tdx
