// The seam between the reducer and a DDP communication hook. The reducer hands each full bucket
// (a torch c10d::GradBucket, so Python hooks written for torch's DDP see the object they expect)
// to the hook as soon as the bucket is ready; the hook starts its communication and returns a
// PendingBucket; at the end of backward the reducer waits on it and copies the result (a tensor
// with the bucket's numel and dtype) into the bucket, and from there into the gradients.
// With a hook registered the bucket holds the local gradients unscaled: dividing by the world
// size is the hook's job (as in torch's DDP).
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <memory>
#include <string>

namespace tdx {

// One bucket's communication in flight.
class PendingBucket {
 public:
  virtual ~PendingBucket() = default;
  // Blocks until done; returns the reduced bucket (may be the bucket's own buffer).
  virtual at::Tensor wait() = 0;
};

class CommHook {
 public:
  virtual ~CommHook() = default;
  virtual std::unique_ptr<PendingBucket> run(c10d::GradBucket& bucket) = 0;
  // For error messages and introspection.
  virtual std::string name() const = 0;
  // The reducer rebuilt its buckets (once, after the first iteration): per-bucket state is stale.
  virtual void bucketsRebuilt() {}
};

}  // namespace tdx
