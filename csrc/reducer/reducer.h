// DDP's engine: gradients are copied (pre-divided by the world size) into flat buckets as their
// accumulators fire during backward, each bucket's all_reduce starts asynchronously as soon as it
// is full (buckets launch in index order so every rank issues the same collectives), and a final
// autograd callback waits for all buckets and writes the averaged gradients back.
// A registered comm hook (comm_hook.h) replaces the all_reduce of each bucket. static_graph
// counts each parameter's hook calls in the first iteration (delaying every bucket to the end of
// that backward) and from then on reduces a parameter when its count is reached, which supports
// parameters whose accumulator fires more than once (reentrant activation checkpointing).
#pragma once

#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "reducer/comm_hook.h"

namespace tdx {

struct ReducerOptions {
  size_t firstBucketBytes = 1u << 20;
  size_t bucketBytes = 25u << 20;
  bool findUnusedParameters = false;
  bool gradientAsBucketView = false;
  bool staticGraph = false;
};

class Reducer {
 public:
  Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
          c10::intrusive_ptr<c10d::ProcessGroup> pg, ReducerOptions opts);
  ~Reducer();
  // Removes the gradient hooks at once (the Reducer may outlive its use: elastic recovery builds
  // a new one over the same parameters while a traceback still holds this one). Idempotent.
  void removeHooks();

  // Called after each forward that will be followed by a synchronized backward. With
  // find_unused_parameters, `outputs` are searched for the parameters that take part. Rebuilds the
  // buckets if that is still due (a guard for callers that skip rebuildBucketsIfDue; the Python
  // DDP forward calls that first, so the layout changes at the point torch's DDP changes it).
  void prepareForBackward(const std::vector<at::Tensor>& outputs);
  // Bucket layout as parameter indices (for tests and introspection).
  std::vector<std::vector<size_t>> bucketIndices() const;
  // Rebuilds the buckets from the observed gradient-ready order if the first synchronized
  // backward has run and they were not rebuilt yet (a broadcast from rank 0: every rank must call
  // it at the same point). Called by every forward with grad enabled, as torch's DDP does.
  bool rebuildBucketsIfDue();
  // Per bucket: whether it is reduced in place in the gradients (see Bucket::direct).
  std::vector<bool> directBuckets() const;
  // Bytes of flat bucket tensors allocated (a direct bucket allocates its own only when needed).
  int64_t bucketBytesAllocated() const;
  // Whether the buckets were rebuilt from the observed gradient-ready order.
  bool rebuilt() const { return rebuilt_; }
  // Replaces each bucket's all_reduce by `hook`; once, before the first backward.
  void registerCommHook(std::shared_ptr<CommHook> hook);
  std::string commHookName() const { return hook_ ? hook_->name() : std::string(); }
  // Queues the end-of-backward callback on the current autograd graph task (static_graph calls
  // it from the outermost backward, so reentrant backwards cannot run it early).
  void queueFinalize();
  // Uneven inputs (join): a rank that ran out of data issues the collectives of one
  // synchronized backward (zeros for every bucket, through the comm hook if any) to match the others.
  void joinShadowBackward();
  int iterations() const { return iterations_; }
  // Gradients are averaged over `factor` ranks instead of the group size from the next bucket on
  // (join(divide_by_initial_world_size=False): the ranks still training); 0 restores the group
  // size. A comm hook divides by itself and ignores it.
  void setDivideFactor(int64_t factor);

 private:
  // The buckets are rebuilt once, from the gradient-ready order observed in the first iteration.
  bool rebuildDue() const { return iterations_ == 1 && !rebuilt_; }
  struct Bucket {
    std::vector<size_t> params;
    std::vector<size_t> offsets;  // element offset of each parameter in `flat`
    int64_t numel = 0;            // elements of `flat`
    at::TensorOptions options;    // dtype and device of the bucket's parameters
    at::Tensor flat;              // undefined in a direct bucket until a slot needs it (ensureFlat)
    std::vector<at::Tensor> views;  // one view of `flat` per parameter, shaped like it
    std::vector<size_t> lengths;
    std::vector<c10::IntArrayRef> sizes;
    // Direct buckets (tdx, CPU, floating, no comm hook, no bucket views) reduce the gradients
    // where they are: one all_reduce over the list `slots` (each parameter's .grad, or its bucket
    // view when it has no usable gradient) with PREMUL_SUM(1/world_size), so neither the copy into
    // the bucket nor the copy back is made. Same bits as scaling into a bucket and summing.
    bool direct = false;
    std::vector<at::Tensor> slots;
    std::vector<bool> inGrad;  // slot k is the parameter's own .grad
    size_t pending = 0;
    c10::intrusive_ptr<c10d::Work> work;         // the default all_reduce
    std::unique_ptr<PendingBucket> inflight;     // or the comm hook's result
  };

  void buildBuckets(const std::vector<size_t>& order);
  // Allocates the bucket's flat tensor (zeros) and its per-parameter views if not yet there.
  void ensureFlat(Bucket& b);
  void autogradHook(size_t index);
  void markReady(size_t index, bool used);
  void launchReadyBuckets();
  void launchBucket(size_t bi, const at::Tensor& flat);
  void launchDirect(size_t bi, std::vector<at::Tensor> tensors);
  // Stores the gradient of a used parameter into its bucket slot, scaled for a plain bucket.
  void fillSlot(size_t index, Bucket& b, size_t pos);
  void waitBucket(size_t bi);
  void queueFinalizeLocked();
  void finalizeBackward();
  void rebuildFromObservedOrder();
  [[noreturn]] void failUnfinished();

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  // The group's CPU backend when it is tdx (it takes PREMUL_SUM, so buckets can be direct).
  c10::intrusive_ptr<c10d::Backend> premulBackend_;
  ReducerOptions opts_;
  int64_t divFactor_;  // what gradients are averaged over (the group size unless setDivideFactor)
  // The gradient accumulators and our post-hooks' keys. The pointer type is whatever this torch's
  // grad_accumulator returns (std::shared_ptr<Node> up to 2.11, c10::intrusive_ptr<Node> after).
  using AccumulatorPtr = std::decay_t<decltype(torch::autograd::impl::grad_accumulator(std::declval<at::Tensor>()))>;
  std::vector<std::pair<AccumulatorPtr, uintptr_t>> hooks_;
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
  std::shared_ptr<CommHook> hook_;
  // static_graph: hook calls per parameter in the first iteration, and left in this one.
  std::vector<int> hookCounts_;
  std::vector<int> remaining_;
  std::vector<bool> staticUsed_;  // globally used, from the first iteration
};

}  // namespace tdx
