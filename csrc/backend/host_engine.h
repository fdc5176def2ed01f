// The engines of CPU tensors: shared memory inside a host (ShmEngine) and, when the group spans
// hosts, shared memory plus torch's Gloo between hosts (HierarchicalEngine over Hierarchy). Both
// run collectives in issue order on one progress queue and report through TdxWork.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <functional>
#include <memory>
#include <string>

#include "backend/collective_queue.h"
#include "backend/engine.h"
#include "backend/tensor_utils.h"
#include "collectives/p2p.h"
#include "multihost/hierarchy.h"
#include "transport/shm/shm_group.h"

namespace tdx {

class HostEngine : public Engine {
 public:
  // `rank`: this rank in the process group (the shared-memory group may hold only this host's ranks).
  HostEngine(std::unique_ptr<shm::ShmGroup> group, int rank);
  ~HostEngine() override;
  void shutdown() override;
  void abort() override { group_->abort(); }
  // The first half of SHRINK_ABORT: every wait of this group (shared memory, Gloo, p2p) fails at
  // once with `reason`; the group refuses further operations.
  void interrupt(const std::string& reason) { group_->abort(reason); }
  // The node ids of the hosts the last cross-host failure named as failed or silent (none on one host).
  virtual std::vector<std::string> failedHosts() const { return {}; }
  // This host's shared-memory group (shrinking builds the survivors' group from it).
  shm::ShmGroup& group() { return *group_; }
  // Tells the host mates already waiting in the call `w` that this rank refused it (`why`), so
  // they raise at once; false where refusals are not posted (a group spanning hosts).
  virtual bool postRefusal(const WaitContext& w, const std::string& why) { return false; }
  // From which output size all_gather reads the peers' inputs directly; 0 where it does not.
  virtual size_t singleCopyBytes() const { return 0; }

 protected:
  // Runs `body` (a callable taking the WaitContext) as the call `c`. A call that wants no Work
  // runs it here when the progress queue gives this thread its turn, and returns null (errors
  // thrown); nothing is allocated for it. Otherwise it goes through submit().
  template <typename Body>
  WorkPtr run(const OpContext& c, Body&& body) {
    if (!c.wantsWork) {
      if (CollectiveQueue::Turn turn = queue_->turn()) {
        try {
          body(waitFromNow(c.name, c.seq, c.timeout));
        } catch (...) {
          rethrowAsTorch(std::current_exception());
        }
        if (postFinished_) group_->postFinished(c.seq);
        return {};
      }
    }
    return submit(c, std::function<void(const WaitContext&)>(std::forward<Body>(body)));
  }
  // Runs `body` as the call `c` on the progress queue (inline when synchronous and idle). Errors
  // complete the Work; the body's captures are dropped before the waiter wakes.
  WorkPtr submit(const OpContext& c, std::function<void(const WaitContext&)> body);
  [[noreturn]] static void rethrowAsTorch(std::exception_ptr err);
  // run() over staged `inputs` (contiguous, copied in) and `outputs` (written back after `body`,
  // a callable taking (const StagedSet& in, const StagedSet& out, const WaitContext&)).
  template <typename Body>
  WorkPtr runStaged(const OpContext& c, const Tensors& inputs, const Tensors& outputs, Body body) {
    StagedSet in{stageAll(inputs)}, out{stageAll(outputs, /*copyIn=*/false)};
    return run(c, [in = std::move(in), out = std::move(out), body = std::move(body)](const WaitContext& ctx) mutable {
      body(in, out, ctx);
      out.finish();
    });
  }
  // run() of an all_gather: `body` once per input i, on staged inputs[i] and output list i (written
  // back after each).
  using GatherBody = std::function<void(const Staged& in, const StagedSet& outs, const WaitContext& ctx)>;
  WorkPtr runPerInput(const OpContext& c, const AllgatherArgs& a, GatherBody body);

  std::unique_ptr<shm::ShmGroup> group_;
  std::unique_ptr<CollectiveQueue> queue_;
  int rank_;
  // Post each finished collective's sequence number in this rank's header (groups spanning hosts,
  // whose Gloo waits watch the host mates: gloo_wait.h). One host posts nothing.
  bool postFinished_ = false;
};

class ShmEngine : public HostEngine {
 public:
  ShmEngine(std::unique_ptr<shm::ShmGroup> group, int rank);
  TDX_ENGINE_OVERRIDES
  void shutdown() override;
  bool postRefusal(const WaitContext& w, const std::string& why) override;
  size_t singleCopyBytes() const override { return group_->singleCopyBytes(); }

 private:
  WorkPtr p2p(P2PArgs a, const OpContext& c, bool isSend);
  // One block of `bytes` per rank of the group from `base` (the flat collectives' layout), in
  // blocks_'s storage: a body hands the list back to blocks_ after its collective, so that calls
  // on this engine (one at a time, in queue order) allocate no list.
  std::vector<Span> equalBlocks(void* base, size_t bytes);
  std::unique_ptr<P2PEngine> p2p_;
  std::vector<Span> blocks_;
};

class HierarchicalEngine : public HostEngine {
 public:
  // `group`: this host's ranks, which the cross-host part `x` uses for its shared-memory phases.
  // Collective over the group (Hierarchy's constructor).
  HierarchicalEngine(std::unique_ptr<shm::ShmGroup> group, CrossHost x, int rank, int size);
  TDX_ENGINE_OVERRIDES
  std::vector<std::string> failedHosts() const override { return hier_->failedHosts(); }

 private:
  std::unique_ptr<Hierarchy> hier_;
  int size_;
};

}  // namespace tdx
