// The shared-memory engine (one host) and the progress plumbing both host engines share. Bodies
// capture Staged tensors (contiguous views, or copies written back after the collective).
#include <c10/util/Exception.h>

#include "backend/host_engine.h"
#include "backend/tensor_utils.h"
#include "backend/work.h"
#include "collectives/collectives.h"
#include "common/env.h"

namespace tdx {

namespace {

// Consecutive blocks of bytes[p] bytes from `base`.
std::vector<Span> cut(void* base, const std::vector<int64_t>& bytes) {
  std::vector<Span> v;
  size_t off = 0;
  for (int64_t b : bytes) {
    v.push_back(Span{static_cast<char*>(base) + off, static_cast<size_t>(b)});
    off += b;
  }
  return v;
}

}  // namespace

std::vector<Span> ShmEngine::equalBlocks(void* base, size_t bytes) {
  std::vector<Span> v = std::move(blocks_);
  v.clear();
  for (int p = 0; p < group_->size(); ++p) v.push_back(Span{static_cast<char*>(base) + p * bytes, bytes});
  return v;
}

HostEngine::HostEngine(std::unique_ptr<shm::ShmGroup> group, int rank)
    : group_(std::move(group)), queue_(std::make_unique<CollectiveQueue>()), rank_(rank) {}

HostEngine::~HostEngine() { shutdown(); }

void HostEngine::shutdown() {
  // Interrupt waits (destroy_process_group may run while another thread is blocked in a
  // collective): queued collectives then fail fast, and the thread stops.
  group_->abort();
  queue_->stop();
}

void HostEngine::rethrowAsTorch(std::exception_ptr err) { std::rethrow_exception(toTorchError(std::move(err))); }

WorkPtr HostEngine::submit(const OpContext& c, std::function<void(const WaitContext&)> body) {
  auto work = c10::make_intrusive<TdxWork>(rank_, c.type, c.seq, c.name, c.outputs, std::nullopt);
  const shm::ShmGroup* posts = postFinished_ ? group_.get() : nullptr;
  queue_->submit(
      [work, name = c.name, seq = c.seq, timeout = c.timeout, posts, body = std::move(body)]() mutable {
        std::exception_ptr err;
        try {
          body(waitFromNow(name, seq, timeout));
          if (posts) posts->postFinished(seq);
        } catch (...) {
          err = std::current_exception();
        }
        // Drop the tensors the body holds (and this task's reference to the Work) before the
        // waiter wakes: a caller that frees its buffers after wait() must see the memory freed
        // then, not whenever this worker thread next gets a core (FSDP's peak memory).
        body = nullptr;
        c10::intrusive_ptr<TdxWork> done = std::move(work);
        done->complete(err);
      },
      !c.asyncOp);
  return work;
}

ShmEngine::ShmEngine(std::unique_ptr<shm::ShmGroup> group, int rank) : HostEngine(std::move(group), rank) {
  p2p_ = std::make_unique<P2PEngine>(
      *group_, [](int dtype) { return std::string(c10::toString(static_cast<c10::ScalarType>(dtype))); });
}

bool ShmEngine::postRefusal(const WaitContext& w, const std::string& why) {
  group_->postRefusal(w, why);
  return true;
}

void ShmEngine::shutdown() {
  HostEngine::shutdown();
  p2p_->shutdown();
}

WorkPtr HostEngine::runPerInput(const OpContext& c, const AllgatherArgs& a, GatherBody body) {
  auto ins = stagedSet(a.inputs);
  auto outs = std::make_shared<std::vector<StagedSet>>();
  for (const auto& list : a.outputs) outs->push_back(StagedSet{stageAll(list, /*copyIn=*/false)});
  return run(c, [ins, outs, body = std::move(body)](const WaitContext& ctx) {
    for (size_t i = 0; i < ins->items.size(); ++i) {
      body(ins->items[i], (*outs)[i], ctx);
      (*outs)[i].finish();
    }
  });
}

WorkPtr ShmEngine::allreduce(ReduceArgs a, const OpContext& c) {
  StagedSet staged{stageAll(a.tensors)};
  return run(c, [this, staged = std::move(staged), a = std::move(a)](const WaitContext& ctx) mutable {
    AllreduceOptions o;
    o.in = o.out = spanList(staged.items);
    o.dtype = a.dtype;
    o.op = a.op;
    o.scale = a.scale;
    o.root = a.root;
    o.oneshotBytes = env().oneshotBytes;
    tdx::allreduce(*group_, o, ctx);
    if (a.root < 0 || group_->rank() == a.root) staged.finish();
  });
}

WorkPtr ShmEngine::broadcast(BroadcastArgs a, const OpContext& c) {
  const int root = a.root;
  auto staged = stagedSet(a.tensors, /*copyIn=*/rank_ == root);
  return run(c, [this, staged, root](const WaitContext& ctx) {
    BroadcastOptions o;
    o.data = spanList(staged->items);
    o.root = root;
    tdx::broadcast(*group_, o, ctx);
    if (group_->rank() != root) staged->finish();
  });
}

WorkPtr ShmEngine::allgather(AllgatherArgs a, const OpContext& c) {
  return runPerInput(c, a, [this](const Staged& in, const StagedSet& outs, const WaitContext& ctx) {
    AllgatherOptions o;
    o.in = in.span();
    o.out = spans(outs.items);
    tdx::allgather(*group_, o, ctx);
  });
}

WorkPtr ShmEngine::allgatherFlat(FlatArgs a, const OpContext& c) {
  return runStaged(c, a.inputs, a.outputs, [this](const StagedSet& in, const StagedSet& out, const WaitContext& ctx) {
    for (size_t i = 0; i < in.items.size(); ++i) {
      AllgatherOptions o;
      o.in = in.items[i].span();
      o.out = equalBlocks(out.items[i].data(), in.items[i].bytes());
      tdx::allgather(*group_, o, ctx);
      blocks_ = std::move(o.out);
    }
  });
}

WorkPtr ShmEngine::gather(RootedArgs a, const OpContext& c) {
  return runStaged(c, a.inputs, a.outputs,
                   [this, root = a.root](const StagedSet& in, const StagedSet& out, const WaitContext& ctx) {
                     AllgatherOptions o;
                     o.in = in.items[0].span();
                     o.out = spans(out.items);
                     o.root = root;
                     tdx::allgather(*group_, o, ctx);
                   });
}

WorkPtr ShmEngine::scatter(RootedArgs a, const OpContext& c) {
  return runStaged(c, a.inputs, a.outputs,
                   [this, root = a.root](const StagedSet& in, const StagedSet& out, const WaitContext& ctx) {
                     ScatterOptions o;
                     o.in = spans(in.items);
                     o.out = out.items[0].span();
                     o.root = root;
                     tdx::scatter(*group_, o, ctx);
                   });
}

WorkPtr ShmEngine::reduceScatter(ReduceScatterArgs a, const OpContext& c) {
  return runStaged(c, a.inputs, {a.output},
                   [this, dt = a.dtype, op = a.op](const StagedSet& in, const StagedSet& out, const WaitContext& ctx) {
                     ReduceScatterOptions o;
                     o.in = spans(in.items);
                     o.out = out.items[0].span();
                     o.dtype = dt;
                     o.op = op;
                     tdx::reduceScatter(*group_, o, ctx);
                   });
}

WorkPtr ShmEngine::reduceScatterFlat(FlatArgs a, const OpContext& c) {
  return runStaged(c, a.inputs, a.outputs,
                   [this, dt = a.dtype, op = a.op](const StagedSet& in, const StagedSet& out, const WaitContext& ctx) {
                     for (size_t i = 0; i < in.items.size(); ++i) {
                       ReduceScatterOptions o;
                       o.in = equalBlocks(in.items[i].data(), out.items[i].bytes());
                       o.out = out.items[i].span();
                       o.dtype = dt;
                       o.op = op;
                       tdx::reduceScatter(*group_, o, ctx);
                       blocks_ = std::move(o.in);
                     }
                   });
}

WorkPtr ShmEngine::alltoall(AlltoallArgs a, const OpContext& c) {
  return runStaged(c, a.inputs, a.outputs,
                   [this, a](const StagedSet& in, const StagedSet& out, const WaitContext& ctx) {
                     AlltoallOptions o;
                     if (a.single) {
                       o.in = cut(in.items[0].data(), a.inBytes);
                       o.out = cut(out.items[0].data(), a.outBytes);
                     } else {
                       o.in = spans(in.items);
                       o.out = spans(out.items);
                     }
                     tdx::alltoall(*group_, o, ctx);
                   });
}

WorkPtr ShmEngine::barrier(const OpContext& c) {
  return run(c, [this](const WaitContext& ctx) { tdx::barrier(*group_, ctx); });
}

WorkPtr ShmEngine::send(P2PArgs a, const OpContext& c) { return p2p(std::move(a), c, true); }
WorkPtr ShmEngine::recv(P2PArgs a, const OpContext& c) { return p2p(std::move(a), c, false); }

WorkPtr ShmEngine::p2p(P2PArgs a, const OpContext& c, bool isSend) {
  auto staged = std::make_shared<Staged>(a.tensor, /*copyIn=*/isSend);
  auto work = c10::make_intrusive<TdxWork>(rank_, c.type, c.seq, c.name, Tensors{a.tensor}, std::nullopt);
  auto done = [work, staged](std::exception_ptr err, int src) {
    if (!err) {
      try {
        staged->finish();
      } catch (...) {
        err = std::current_exception();
      }
    }
    work->complete(err, src);
  };
  const WaitContext ctx = waitFromNow(c.name, c.seq, c.timeout);
  const int dtype = static_cast<int>(a.tensor.scalar_type());
  if (isSend) {
    p2p_->send(staged->data(), staged->bytes(), a.peer, a.tag, ctx, std::move(done), dtype);
  } else {
    p2p_->recv(staged->data(), staged->bytes(), a.peer, a.tag, ctx, std::move(done), dtype);
  }
  return work;
}

}  // namespace tdx
