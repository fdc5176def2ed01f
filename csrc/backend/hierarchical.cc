// The multi-host mode: shared memory inside a host, Gloo between hosts (see hierarchical.h).
#include "backend/hierarchical.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <thread>

#include "backend/gloo_wait.h"
#include "backend/tensor_utils.h"
#include "backend/xhost_int8.h"
#include "collectives/collectives.h"
#include "collectives/op_desc.h"
#include "collectives/reduce_kernels.h"
#include "common/env.h"
#include "common/logging.h"

namespace tdx {

namespace {

// Concatenates contiguous tensors into one flat tensor of `numel` elements (zero padded).
at::Tensor pack(const std::vector<at::Tensor>& ts, int64_t numel) {
  if (ts.size() == 1 && ts[0].numel() == numel) return ts[0].view({-1});
  at::Tensor flat = at::zeros({numel}, ts[0].options());
  int64_t off = 0;
  for (const auto& t : ts) {
    flat.narrow(0, off, t.numel()).copy_(t.view({-1}));
    off += t.numel();
  }
  return flat;
}

void unpack(const at::Tensor& flat, const std::vector<at::Tensor>& ts) {
  if (ts.size() == 1 && flat.data_ptr() == ts[0].data_ptr()) return;  // pack() returned a view
  int64_t off = 0;
  for (const auto& t : ts) {
    t.view({-1}).copy_(flat.narrow(0, off, t.numel()));
    off += t.numel();
  }
}

// The Gloo p2p tags of the small broadcast's and the barrier's messages on the all-ranks group
// (user p2p may not use them).
constexpr int kBroadcastTag = 0x7ffffffe;
constexpr int kBarrierTag = 0x7ffffffd;
// The largest broadcast of the flat route sent as Gloo p2p (hosts bench, 2 x 2 ranks unshaped, 4
// alternating runs: p2p 0.88x-0.98x gloo's speed at 4-256 KB against 0.84x-0.94x for Gloo's
// broadcast; at 1-2 MB 0.84x-0.89x against 0.96x-0.97x).
constexpr uint64_t kP2PBroadcastMax = 512u << 10;

void checkUserTag(int tag) {
  TORCH_CHECK_VALUE(tag != kBroadcastTag && tag != kBarrierTag, "tdx: p2p tag ", tag,
                    " is reserved by tdx on groups spanning hosts (its broadcast and barrier use ", kBarrierTag,
                    " and ", kBroadcastTag, "); use another tag");
}

// p2p through Gloo; a receive into a non-contiguous tensor is written back on wait().
class GlooP2PWork : public c10d::Work {
 public:
  GlooP2PWork(c10::intrusive_ptr<c10d::Work> inner, std::shared_ptr<Staged> staged, bool writeBack, int rank,
              c10d::OpType type, at::Tensor user)
      : c10d::Work(rank, type), inner_(std::move(inner)), staged_(std::move(staged)), writeBack_(writeBack),
        user_(std::move(user)) {}
  bool isCompleted() override { return inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  int sourceRank() const override { return inner_->sourceRank(); }
  std::vector<at::Tensor> result() override { return {user_}; }
  void abort() override { inner_->abort(); }
  bool wait(std::chrono::milliseconds timeout) override {
    const bool ok = inner_->wait(timeout);
    if (writeBack_ && !written_) {
      staged_->finish();
      written_ = true;
    }
    return ok;
  }

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
  std::shared_ptr<Staged> staged_;
  bool writeBack_;
  bool written_ = false;
  at::Tensor user_;
};

}  // namespace

HostLayout computeHostLayout(const std::vector<std::string>& nodeIds, int rank) {
  HostLayout l;
  std::map<std::string, int> hostOf;
  std::vector<int> counts;
  for (const auto& id : nodeIds) {
    auto it = hostOf.find(id);
    if (it == hostOf.end()) {
      hostOf.emplace(id, static_cast<int>(counts.size()));
      counts.push_back(0);
    }
    ++counts[hostOf[id]];
  }
  l.numHosts = static_cast<int>(counts.size());
  l.hostRanks.resize(counts.size());
  for (int r = 0; r < static_cast<int>(nodeIds.size()); ++r) l.hostRanks[hostOf.at(nodeIds[r])].push_back(r);
  l.hostIndex = hostOf.at(nodeIds.at(rank));
  for (int r = 0; r < static_cast<int>(nodeIds.size()); ++r) {
    if (nodeIds[r] != nodeIds[rank]) continue;
    if (r == rank) l.localRank = static_cast<int>(l.localRanks.size());
    l.localRanks.push_back(r);
  }
  l.localSize = static_cast<int>(l.localRanks.size());
  for (int c : counts) l.uniform = l.uniform && c == l.localSize;
  return l;
}

Hierarchy::Hierarchy(HostLayout layout, int rank, int size, c10::intrusive_ptr<c10d::Backend> all,
                     c10::intrusive_ptr<c10d::Backend> slice, c10::intrusive_ptr<c10d::Store> store,
                     std::vector<std::string> nodeIds, std::vector<int64_t> globalRanks)
    : layout_(std::move(layout)),
      failures_(std::move(store), rank, std::move(nodeIds), std::move(globalRanks)),
      rank_(rank),
      size_(size),
      all_(std::move(all)),
      slice_(std::move(slice)) {
  TORCH_CHECK(all_, "tdx: the group spans ", layout_.numHosts, " hosts but no Gloo process group was passed for "
              "the cross-host part; create tdx groups through torch.distributed (import torchdist_ext)");
  if (!layout_.uniform) slice_.reset();
}

void Hierarchy::runLocal(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    std::string what = e.what();
    // A host mate this rank timed out on may be failing in its cross-host part at this moment:
    // its Gloo deadline started when it reached the network, which on a loaded host can be a few
    // seconds after this rank's shared-memory wait began. Give it that long to say why (still
    // within the timeout + 5 s every rank is held to), and quote it.
    if (local_ && what.find("timed out") != std::string::npos) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(3);
      std::string cause;
      while (cause.empty() && std::chrono::steady_clock::now() < until) {
        for (int p = 0; p < local_->size() && cause.empty(); ++p) {
          if (p != local_->rank()) cause = local_->peerFailure(p);
        }
        if (cause.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      if (!cause.empty()) what = str(what, " because its host mate failed: ", cause);
    }
    // Tell the other hosts, whose ranks only see their Gloo connections close, what happened here.
    failures_.post(what);
    throw Error(what);
  }
}

void Hierarchy::waitGloo(const c10::intrusive_ptr<c10d::Work>& work, const WaitContext& ctx,
                         const std::function<void()>& check) {
  waitGloo(std::vector<c10::intrusive_ptr<c10d::Work>>{work}, ctx, check);
}

void Hierarchy::waitGloo(const std::vector<c10::intrusive_ptr<c10d::Work>>& works, const WaitContext& ctx,
                         const std::function<void()>& check) {
  bool checkFailed = false;
  std::function<void()> guarded;
  if (check) {
    guarded = [&] {
      try {
        check();
      } catch (...) {
        checkFailed = true;
        throw;
      }
    };
  }
  try {
    // Each ends early when a host mate failed.
    if (works.size() == 1) {
      waitGlooWatchingHost(works[0], ctx, local_, {all_, slice_}, guarded);
    } else {
      waitGlooP2PWatchingHost(works, ctx, local_, {all_, slice_}, guarded);
    }
  } catch (const std::exception& e) {
    if (checkFailed) throw;  // the check's own error (a mismatch) says what happened
    failGloo(e, ctx);
  }
}

void Hierarchy::failGloo(const std::exception& e, const WaitContext& ctx) {
  const std::string msg = failures_.explain(e, ctx);
  // This host's ranks waiting for this one in shared memory fail at once, quoting the cause.
  if (local_) local_->markFailed(ctx, msg);
  throw Error(msg);
}

void Hierarchy::postGloo(std::vector<c10::intrusive_ptr<c10d::Work>>& works, const std::function<void()>& post,
                         const WaitContext& ctx) {
  try {
    post();
  } catch (const std::exception& e) {
    keepAbandoned(works);
    failGloo(e, ctx);
  }
}

void Hierarchy::attachLocal(shm::ShmGroup* local) {
  local_ = local;
  // Full checks if any rank asks; the cross-host knobs must match, since they choose the route.
  auto code = [](const std::string& v, std::initializer_list<const char*> names) {
    int i = 0;
    for (const char* n : names) {
      if (v == n) return i;
      ++i;
    }
    return i;
  };
  const int algo = code(env().xhostAlgo, {"auto", "sliced", "flat"});
  const int comp = code(env().xhostCompress, {"none", "bf16", "fp16", "int8"});
  at::Tensor flags = at::tensor({local->fullChecks() ? 1 : 0, algo, -algo, comp, -comp}, at::kInt);
  std::vector<at::Tensor> v{flags};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp(c10d::ReduceOp::MAX);
  WaitContext ctx;
  ctx.op = "init (agreeing on mismatch checks and the cross-host knobs)";
  waitGloo(all_->allreduce(v, o), ctx);
  const int* f = flags.data_ptr<int>();
  fullChecks_ = f[0] != 0;
  if (f[1] != -f[2] || f[3] != -f[4]) {
    throw Error(str("tdx: the ranks of this group set TDX_XHOST_ALGO or TDX_XHOST_COMPRESS differently (this rank: ",
                    "TDX_XHOST_ALGO=", env().xhostAlgo, ", TDX_XHOST_COMPRESS=", env().xhostCompress,
                    "); give every rank the same values"));
  }
  if (slice_ && layout_.localSize > 1 && env().xhostAlgo == "auto") {
    ctx.op = "init (measuring the host link)";
    measureLink(ctx);
  }
}

Hierarchy::Agreement Hierarchy::beginAgree(const shm::OpDesc& mine, const WaitContext& ctx, bool checkBytes) {
  Agreement a;
  a.desc = mine;
  a.checkBytes = checkBytes;
  shm::OpDesc d = mine;
  d.history = history_;
  history_ = nextHistory(history_, d);
  if (!fullChecks_) {
    // Cheap: this host's ranks compare (in confirmAgree). A mismatch with another host surfaces
    // there at the group timeout, in the Gloo part, naming this operation and sequence number.
    if (local_ && local_->size() > 1) runLocal([&] { a.pending = tdx::beginAgree(*local_, mine, ctx); });
    return a;
  }
  // Full: every rank of the group compares every rank's descriptor (not the host's check first:
  // a host that raised alone would leave the other hosts waiting in this all_gather).
  constexpr int kFields = 7;
  at::Tensor row = at::tensor({static_cast<int64_t>(d.seq), static_cast<int64_t>(d.op),
                               static_cast<int64_t>(d.dtype), static_cast<int64_t>(d.bytes),
                               static_cast<int64_t>(d.root), static_cast<int64_t>(d.redop),
                               static_cast<int64_t>(d.history)},
                              at::kLong);
  at::Tensor all = at::empty({size_ * kFields}, at::kLong);
  waitGloo(all_->_allgather_base(all, row), ctx);
  const int64_t* rows = all.data_ptr<int64_t>();
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    const int64_t* f = rows + r * kFields;
    shm::OpDesc t{};
    t.seq = static_cast<uint64_t>(f[0]);
    t.op = static_cast<uint32_t>(f[1]);
    t.dtype = static_cast<uint32_t>(f[2]);
    t.bytes = static_cast<uint64_t>(f[3]);
    t.root = static_cast<int32_t>(f[4]);
    t.redop = static_cast<int32_t>(f[5]);
    t.history = static_cast<uint64_t>(f[6]);
    const bool same = t.seq == d.seq && t.op == d.op && t.dtype == d.dtype && (!checkBytes || t.bytes == d.bytes) &&
                      t.root == d.root && t.redop == d.redop;
    if (same && t.history == d.history) continue;
    std::string msg = same ? historyMismatch(local_ ? local_->info().name : "", std::to_string(rank_), d, shm::OpDesc{},
                                             std::to_string(r), shm::OpDesc{})
                           : str("tdx: mismatched collectives across hosts: rank ", rank_, " expects ",
                                 describeDesc(d), " but rank ", r, " called ", describeDesc(t),
                                 ". Every rank must call the same collectives in the same order with the same "
                                 "dtype, size, root and reduce op");
    throw Error(msg);
  }
  return a;
}

void Hierarchy::confirmAgree(Agreement& a, const WaitContext& ctx) {
  if (a.pending.half < 0) return;
  const PendingAgree p = a.pending;
  a.pending = PendingAgree{};
  runLocal([&] { tdx::finishAgree(*local_, p, a.desc, ctx, a.checkBytes); });
}

void Hierarchy::agree(const shm::OpDesc& mine, const WaitContext& ctx, bool checkBytes) {
  Agreement a = beginAgree(mine, ctx, checkBytes);
  confirmAgree(a, ctx);
}

void Hierarchy::runFirstLocal(Agreement& a, const std::function<void()>& fn, const WaitContext& ctx) {
  runLocal([&] {
    try {
      fn();
    } catch (const Error&) {
      // The step's own check names the step (a reduce_scatter inside an all_reduce, say); the
      // host mates that published this operation's descriptor tell what the caller mismatched.
      if (a.pending.half >= 0) recheckAgree(*local_, a.pending, a.desc, a.checkBytes);
      throw;
    }
  });
  confirmAgree(a, ctx);
}

c10d::ReduceOp::RedOpType Hierarchy::glooOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kProduct: return c10d::ReduceOp::PRODUCT;
    case ReduceOp::kMin: return c10d::ReduceOp::MIN;
    case ReduceOp::kMax: return c10d::ReduceOp::MAX;
    case ReduceOp::kBand: return c10d::ReduceOp::BAND;
    case ReduceOp::kBor: return c10d::ReduceOp::BOR;
    case ReduceOp::kBxor: return c10d::ReduceOp::BXOR;
    case ReduceOp::kSum: case ReduceOp::kAvg: break;
  }
  return c10d::ReduceOp::SUM;
}

Hierarchy::GlooReduction Hierarchy::startGlooAllreduce(c10d::Backend& pg, const at::Tensor& flat, ReduceOp op,
                                                       int root) {
  // Gloo has no AVG, no int16, and bool only as bytes: map to what it has, exactly.
  at::Tensor t = flat;
  c10d::ReduceOp::RedOpType gop = glooOp(op);
  if (flat.scalar_type() == at::kBool) {
    // tdx's bool semantics: SUM/MAX are OR, PRODUCT/MIN are AND.
    t = bytesOf(flat);
    if (gop == c10d::ReduceOp::SUM || gop == c10d::ReduceOp::MAX) gop = c10d::ReduceOp::BOR;
    if (gop == c10d::ReduceOp::PRODUCT || gop == c10d::ReduceOp::MIN) gop = c10d::ReduceOp::BAND;
  } else if (flat.scalar_type() == at::kShort) {
    // Widening is exact for every op (sums and products wrap the same way modulo 2^16).
    t = flat.to(at::kInt);
  } else if (flat.scalar_type() == at::kFloat && (op == ReduceOp::kSum || op == ReduceOp::kAvg) &&
             env().xhostCompress == "int8" && &pg == slice_.get()) {
    // Blockwise int8: every host's packet goes to every host, which sums them in host order.
    at::Tensor packet = int8Pack(flat);
    std::vector<std::vector<at::Tensor>> ov(1);
    for (int h = 0; h < layout_.numHosts; ++h) ov[0].push_back(at::empty_like(packet));
    std::vector<at::Tensor> iv{packet};
    auto work = pg.allgather(ov, iv);
    return GlooReduction{work, flat, packet, op, ov[0]};
  } else if (flat.scalar_type() == at::kFloat && (op == ReduceOp::kSum || op == ReduceOp::kAvg) &&
             (env().xhostCompress == "bf16" || env().xhostCompress == "fp16")) {
    // TDX_XHOST_COMPRESS: half the bytes on the host links; Gloo's result is the same on every rank.
    t = flat.to(env().xhostCompress == "bf16" ? at::kBFloat16 : at::kHalf);
  }
  std::vector<at::Tensor> v{t};
  if (root >= 0) {
    c10d::ReduceOptions o;
    o.reduceOp = c10d::ReduceOp(gop);
    o.rootRank = root;
    return GlooReduction{pg.reduce(v, o), flat, t, op};
  }
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp(gop);
  return GlooReduction{pg.allreduce(v, o), flat, t, op};
}

bool Hierarchy::compressesOnLink(at::ScalarType dtype, ReduceOp op) {
  return dtype == at::kFloat && (op == ReduceOp::kSum || op == ReduceOp::kAvg) && env().xhostCompress != "none";
}

bool Hierarchy::chainsReduce(at::ScalarType dtype, ReduceOp op) const {
  return layout_.numHosts > 2 && slice_ && !compressesOnLink(dtype, op);
}

bool Hierarchy::exchangesSlices(at::ScalarType dtype, ReduceOp op) const {
  return layout_.numHosts == 2 && slice_ && !compressesOnLink(dtype, op);
}

Hierarchy::GlooReduction Hierarchy::startSliceExchange(const at::Tensor& flat, const at::Tensor& partials,
                                                       ReduceOp op, DataType dt) {
  // A Gloo all_gather between two ranks is one message each way (its all_reduce takes two
  // dependent steps); being a collective, its wait still watches the host mates.
  TDX_CHECK_EQ(partials.numel(), flat.numel() * layout_.numHosts);
  GlooReduction r;
  r.flat = flat;
  r.sent = flat;
  r.op = op;
  r.dt = dt;
  // As bytes, so every dtype moves (Gloo's all_gather refuses some, bool and int16 among them).
  std::vector<std::vector<at::Tensor>> ov(1);
  for (int h = 0; h < layout_.numHosts; ++h) {
    r.partials.push_back(partials.narrow(0, h * flat.numel(), flat.numel()));
    ov[0].push_back(bytesOf(r.partials.back()));
  }
  std::vector<at::Tensor> iv{bytesOf(flat)};
  r.work = slice_->allgather(ov, iv);
  return r;
}

void Hierarchy::finishGlooAllreduce(GlooReduction& r, const WaitContext& ctx) {
  waitGloo(r.work, ctx);
  if (!r.partials.empty()) {
    std::vector<const void*> parts;
    for (const auto& p : r.partials) parts.push_back(p.data_ptr());
    const ReduceOp op = r.op == ReduceOp::kAvg ? ReduceOp::kSum : r.op;
    reduceInto(r.flat.data_ptr(), parts.data(), static_cast<int>(parts.size()), static_cast<size_t>(r.flat.numel()),
               r.dt, op);
    if (r.op == ReduceOp::kAvg) r.flat.div_(size_);
    return;
  }
  if (!r.packets.empty()) {
    int8SumPackets(r.packets, r.flat);
  } else if (!r.sent.is_same(r.flat) && r.flat.scalar_type() != at::kBool) {
    r.flat.copy_(r.sent);
  }
  if (r.op == ReduceOp::kAvg) r.flat.div_(size_);
}

void Hierarchy::glooAllreduce(c10d::Backend& pg, const at::Tensor& flat, ReduceOp op, const WaitContext& ctx) {
  GlooReduction r = startGlooAllreduce(pg, flat, op);
  finishGlooAllreduce(r, ctx);
}

void Hierarchy::allreduce(shm::ShmGroup& local, const std::vector<at::Tensor>& tensors, ReduceOp op,
                          const WaitContext& ctx, int root, bool keepInputs) {
  int64_t n = 0;
  for (const auto& t : tensors) n += t.numel();
  const uint64_t bytes = static_cast<uint64_t>(n) * tensors[0].element_size();
  Agreement a = beginAgree(makeDesc(ctx, root >= 0 ? OpCode::kReduce : OpCode::kAllreduce,
                                    reduceDtype("all_reduce", tensors[0].scalar_type()), bytes, root, op, true),
                           ctx);
  if (n == 0) return confirmAgree(a, ctx);
  const bool flatR = flatRoute(root >= 0 ? OpCode::kReduce : OpCode::kAllreduce, bytes, tensors[0].scalar_type(), op);
  const int L = layout_.localSize;
  const int64_t blk = (n + L - 1) / L;
  const int slicedRoot = reduceAsAllreduce(bytes) ? -1 : root;
  at::Tensor flat = pack(tensors, flatR ? n : blk * L);
  // Only the sliced reduce leaves the other ranks' data as it was; the other routes write it, so
  // kept inputs are copied first unless pack() already made a copy.
  // With one rank per host the slices are whole arrays and need no shared-memory phases: Gloo's
  // all_reduce (reduce) of them, except for a reduce that passes up a chain of hosts, from H - 1
  // chunks of the smallest size (4 hosts x 1, 1 Gbit/s, 1 MB: 0.95x gloo as a chain, 0.99x without).
  const bool chainR = slicedRoot >= 0 && chainsReduce(tensors[0].scalar_type(), op) &&
                      n >= (layout_.numHosts - 1) * chunkElems(tensors[0], 0);
  const bool gloo = flatR || (L == 1 && !chainR);
  const bool writes = gloo || slicedRoot < 0;
  if (keepInputs && writes && flat.data_ptr() == tensors[0].data_ptr()) flat = flat.clone();
  if (gloo) {
    confirmAgree(a, ctx);
    GlooReduction r = startGlooAllreduce(flatR ? *all_ : *slice_, flat, op, flatR ? root : -1);
    finishGlooAllreduce(r, ctx);
  } else {
    slicedAllreduce(local, flat, blk, op, a, ctx, slicedRoot);
  }
  if (!keepInputs) unpack(flat, tensors);
}

void Hierarchy::reduceScatter(shm::ShmGroup& local, const at::Tensor& output, const std::vector<at::Tensor>& blocks,
                              const at::Tensor& whole, ReduceOp op, const WaitContext& ctx) {
  const uint64_t inBytes = output.nbytes() * blocks.size();
  if (slice_) {
    Agreement a = beginAgree(makeDesc(ctx, OpCode::kReduceScatter, reduceDtype("reduce_scatter", output.scalar_type()),
                                      output.nbytes(), -1, op, true),
                             ctx);
    if (flatRoute(OpCode::kReduceScatter, inBytes, output.scalar_type(), op)) {
      confirmAgree(a, ctx);
      flatReduceScatter(output, blocks, whole, op, ctx);
    } else {
      slicedReduceScatter(local, output, blocks, op, a, ctx);
    }
    return;
  }
  // Hosts of unequal sizes: a copy of the whole input is all-reduced and this rank keeps its block.
  at::Tensor flat = at::cat(blocks);
  allreduce(local, {flat}, op, ctx);
  const int64_t m = output.numel();
  output.copy_(flat.narrow(0, rank_ * m, m).view(output.sizes()));
}

void Hierarchy::broadcast(const std::vector<at::Tensor>& tensors, int root, const WaitContext& ctx) {
  uint64_t bytes = 0;
  for (const auto& t : tensors) bytes += t.nbytes();
  Agreement a = beginAgree(makeDesc(ctx, OpCode::kBroadcast, DataType::kBytes, bytes, root), ctx);
  if (slice_ && local_ && !flatRoute(OpCode::kBroadcast, bytes)) {
    confirmAgree(a, ctx);
    return slicedBroadcast(tensors, root, ctx);
  }
  // Gloo's broadcast starts before this host's ranks have compared descriptors: waiting for a late
  // host mate first put its lateness on the root's path (unshaped, 64 KB-1 MB: 0.78-0.83x Gloo's
  // own broadcast; 1.00x without the wait). The descriptors are compared while Gloo runs (host mates
  // that disagree on the root raise within one watch period, 20 ms; the group is failed then, as
  // after any mismatch) and once more when it is done.
  const shm::OpDesc desc = a.desc;
  const PendingAgree pending = a.pending;
  auto check = [&] {
    if (pending.half >= 0) runLocal([&] { recheckAgree(*local_, pending, desc); });
  };
  if (bytes <= kP2PBroadcastMax) {
    // Gloo's p2p from the root to every rank (what Gloo's broadcast sends), posted and waited for
    // on this thread: Gloo's collectives hand each operation to a worker thread and back, which
    // on busy cores cost small broadcasts more than the network did (docs/multihost.md).
    const int rootHost = placeOf(root).first;
    std::vector<Staged> staged = stageAll(tensors, /*copyIn=*/rank_ == root);
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    postGloo(works, [&] {
      for (const auto& s : staged) {
        if (s.bytes() == 0) continue;
        std::vector<at::Tensor> v{bytesOf(s.tensor())};
        if (rank_ != root) {
          works.push_back(all_->recv(v, root, kBroadcastTag));
          continue;
        }
        for (int i = 1; i < size_; ++i) {  // the next ranks first: other hosts' before the root's mates
          const int r = (root + i) % size_;
          if (placeOf(r).first != rootHost) works.push_back(all_->send(v, r, kBroadcastTag));
        }
        for (int r : layout_.localRanks) {
          if (r != root) works.push_back(all_->send(v, r, kBroadcastTag));
        }
      }
    }, ctx);
    if (!works.empty()) waitGloo(works, ctx, check);
    if (rank_ != root) finishAll(staged);
    confirmAgree(a, ctx);
    return;
  }
  for (const auto& t : tensors) {
    Staged s(t, /*copyIn=*/rank_ == root);
    std::vector<at::Tensor> v{bytesOf(s.tensor())};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    waitGloo(all_->broadcast(v, o), ctx, check);
    if (rank_ != root) s.finish();
  }
  confirmAgree(a, ctx);
}

void Hierarchy::allgather(const std::vector<at::Tensor>& outputs, const at::Tensor& input, const WaitContext& ctx) {
  agree(makeDesc(ctx, OpCode::kAllgather, DataType::kBytes, input.nbytes()), ctx, /*checkBytes=*/false);
  bool equal = true;
  for (const auto& o : outputs) equal = equal && o.nbytes() == input.nbytes();
  if (slice_ && local_ && equal && !flatRoute(OpCode::kAllgather, input.nbytes() * size_)) {
    return slicedAllgather(outputs, input, ctx);
  }
  Staged in(input);
  std::vector<Staged> outs = stageAll(outputs, /*copyIn=*/false);
  bool even = true;
  for (const auto& o : outs) even = even && o.bytes() == in.bytes();
  if (even) {
    std::vector<std::vector<at::Tensor>> ov(1);
    for (const auto& o : outs) ov[0].push_back(bytesOf(o.tensor()));
    std::vector<at::Tensor> iv{bytesOf(in.tensor())};
    waitGloo(all_->allgather(ov, iv), ctx);
  } else {
    // Gloo's all_gather needs equal sizes: each rank broadcasts its block in turn.
    for (int p = 0; p < size_; ++p) {
      at::Tensor b = bytesOf(outs[p].tensor());
      if (p == rank_) b.copy_(bytesOf(in.tensor()));
      std::vector<at::Tensor> v{b};
      c10d::BroadcastOptions o;
      o.rootRank = p;
      waitGloo(all_->broadcast(v, o), ctx);
    }
  }
  finishAll(outs);
}

void Hierarchy::gather(const std::vector<at::Tensor>& outputs, const at::Tensor& input, int root,
                       const WaitContext& ctx) {
  Staged in(input);
  std::vector<Staged> outs = stageAll(outputs, /*copyIn=*/false);
  std::vector<std::vector<at::Tensor>> ov;
  agree(makeDesc(ctx, OpCode::kGather, DataType::kBytes, input.nbytes(), root), ctx);
  if (rank_ == root) {
    ov.emplace_back();
    for (const auto& o : outs) ov[0].push_back(bytesOf(o.tensor()));
  }
  std::vector<at::Tensor> iv{bytesOf(in.tensor())};
  c10d::GatherOptions o;
  o.rootRank = root;
  waitGloo(all_->gather(ov, iv, o), ctx);
  finishAll(outs);
}

void Hierarchy::scatter(const at::Tensor& output, const std::vector<at::Tensor>& inputs, int root,
                        const WaitContext& ctx) {
  Staged out(output, /*copyIn=*/false);
  agree(makeDesc(ctx, OpCode::kScatter, DataType::kBytes, output.nbytes(), root), ctx);
  std::vector<Staged> ins = stageAll(inputs);
  std::vector<std::vector<at::Tensor>> iv;
  if (rank_ == root) {
    iv.emplace_back();
    for (const auto& i : ins) iv[0].push_back(bytesOf(i.tensor()));
  }
  std::vector<at::Tensor> ov{bytesOf(out.tensor())};
  c10d::ScatterOptions o;
  o.rootRank = root;
  waitGloo(all_->scatter(ov, iv, o), ctx);
  out.finish();
}

void Hierarchy::alltoallBytes(const at::Tensor& output, const at::Tensor& input, const std::vector<int64_t>& outBytes,
                              const std::vector<int64_t>& inBytes, const WaitContext& ctx) {
  agree(makeDesc(ctx, OpCode::kAlltoall, DataType::kBytes, 0), ctx, /*checkBytes=*/false);
  Staged in(input);
  Staged out(output, /*copyIn=*/false);
  at::Tensor ob = bytesOf(out.tensor()), ib = bytesOf(in.tensor());
  std::vector<int64_t> os = outBytes, is = inBytes;
  waitGloo(all_->alltoall_base(ob, ib, os, is), ctx);
  out.finish();
}

void Hierarchy::alltoall(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs,
                         const WaitContext& ctx) {
  std::vector<at::Tensor> inBytes;
  std::vector<int64_t> is, os;
  int64_t outTotal = 0;
  for (const auto& t : inputs) {
    inBytes.push_back(bytesOf(t.contiguous()));
    is.push_back(inBytes.back().numel());
  }
  for (const auto& t : outputs) {
    os.push_back(t.nbytes());
    outTotal += os.back();
  }
  at::Tensor in = at::cat(inBytes);
  at::Tensor out = at::empty({outTotal}, in.options());
  alltoallBytes(out, in, os, is, ctx);
  int64_t off = 0;
  for (size_t p = 0; p < outputs.size(); ++p) {
    Staged s(outputs[p], /*copyIn=*/false);
    bytesOf(s.tensor()).copy_(out.narrow(0, off, os[p]));
    s.finish();
    off += os[p];
  }
}

void Hierarchy::barrier(const WaitContext& ctx) {
  agree(makeDesc(ctx, OpCode::kBarrier, DataType::kBytes, 0), ctx);
  if (fullChecks_) return;  // agree was a Gloo all_gather over all ranks: a barrier already
  if (!local_) return waitGloo(all_->barrier(c10d::BarrierOptions()), ctx);  // no host group attached (yet)
  // This host's ranks are all here (agree waited for them). The host's first rank tells every other
  // host's first rank so and waits to hear the same from each (Gloo p2p on this thread); its host
  // mates wait for it in shared memory. Gloo's barrier over all ranks, through its worker thread,
  // took 1.55-1.85 ms at 2 x 2 simulated hosts against gloo's 1.18-1.23 ms and released the ranks
  // up to 1.9 ms apart (scripts/probe_simhosts.py barrier).
  if (layout_.localRanks[0] == rank_) {
    const int H = layout_.numHosts;
    at::Tensor heard = at::empty({H}, at::kByte), told = at::zeros({1}, at::kByte);
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    postGloo(works, [&] {
      for (int h = 0; h < H; ++h) {
        if (h == layout_.hostIndex) continue;
        std::vector<at::Tensor> r{heard.narrow(0, h, 1)};
        works.push_back(all_->recv(r, layout_.hostRanks[h][0], kBarrierTag));
      }
      for (int h = 0; h < H; ++h) {
        if (h == layout_.hostIndex) continue;
        std::vector<at::Tensor> v{told};
        works.push_back(all_->send(v, layout_.hostRanks[h][0], kBarrierTag));
      }
    }, ctx);
    waitGloo(works, ctx);
  }
  if (local_->size() > 1) {
    // A little past the operation's deadline: a first rank's failure across hosts (its own deadline)
    // then reaches its host mates as its cause, not as a rank that did not arrive.
    WaitContext release = ctx;
    if (ctx.timeout.count() > 0) release.deadline += std::chrono::seconds(2);
    runLocal([&] { tdx::barrier(*local_, release); });
  }
}

c10::intrusive_ptr<c10d::Work> Hierarchy::send(const at::Tensor& tensor, int dst, int tag) {
  checkUserTag(tag);
  auto staged = std::make_shared<Staged>(tensor);
  std::vector<at::Tensor> v{bytesOf(staged->tensor())};
  return c10::make_intrusive<GlooP2PWork>(all_->send(v, dst, tag), staged, false, rank_, c10d::OpType::SEND, tensor);
}

c10::intrusive_ptr<c10d::Work> Hierarchy::recv(const at::Tensor& tensor, int src, int tag) {
  checkUserTag(tag);
  auto staged = std::make_shared<Staged>(tensor, /*copyIn=*/false);
  std::vector<at::Tensor> v{bytesOf(staged->tensor())};
  auto inner = src < 0 ? all_->recvAnysource(v, tag) : all_->recv(v, src, tag);
  return c10::make_intrusive<GlooP2PWork>(std::move(inner), staged, !staged->tensor().is_same(tensor), rank_,
                                          src < 0 ? c10d::OpType::RECVANYSOURCE : c10d::OpType::RECV, tensor);
}

}  // namespace tdx
