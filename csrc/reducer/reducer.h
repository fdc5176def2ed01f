// DDP's engine: gradients are copied (pre-divided by the world size) into flat buckets as their
// accumulators fire during backward, each bucket's all_reduce starts asynchronously as soon as it
// is full (buckets launch in index order so every rank issues the same collectives), and a final
// autograd callback waits for all buckets and writes the averaged gradients back.
#pragma once

#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace tdx {

struct ReducerOptions {
  size_t firstBucketBytes = 1u << 20;
  size_t bucketBytes = 25u << 20;
  bool findUnusedParameters = false;
  bool gradientAsBucketView = false;
};

class Reducer {
 public:
  Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
          c10::intrusive_ptr<c10d::ProcessGroup> pg, ReducerOptions opts);
  ~Reducer();

  // Called after each forward that will be followed by a synchronized backward. With
  // find_unused_parameters, `outputs` are searched for the parameters that take part.
  void prepareForBackward(const std::vector<at::Tensor>& outputs);
  // Bucket layout as parameter indices (for tests and introspection).
  std::vector<std::vector<size_t>> bucketIndices() const;
  // Whether the buckets were rebuilt from the observed gradient-ready order.
  bool rebuilt() const { return rebuilt_; }

 private:
  struct Bucket {
    std::vector<size_t> params;
    std::vector<size_t> offsets;  // element offset of each parameter in `flat`
    at::Tensor flat;
    std::vector<at::Tensor> views;  // one view of `flat` per parameter, shaped like it
    size_t pending = 0;
    c10::intrusive_ptr<c10d::Work> work;
  };

  void buildBuckets(const std::vector<size_t>& order);
  void autogradHook(size_t index);
  void markReady(size_t index, bool used);
  void launchReadyBuckets();
  void finalizeBackward();
  void rebuildFromObservedOrder();
  [[noreturn]] void failUnfinished();

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  ReducerOptions opts_;
  std::vector<std::pair<c10::intrusive_ptr<torch::autograd::Node>, uintptr_t>> hooks_;
  std::vector<Bucket> buckets_;
  std::vector<std::pair<size_t, size_t>> where_;  // param -> (bucket, position)
  std::mutex mu_;
  // Per-backward state.
  bool expectBackward_ = false;
  bool callbackQueued_ = false;
  size_t nextBucket_ = 0;
  std::vector<bool> ready_;
  std::vector<bool> locallyUsed_;
  std::vector<size_t> readyOrder_;
  bool rebuilt_ = false;
  int iterations_ = 0;
};

}  // namespace tdx
