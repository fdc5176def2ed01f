// The multi-host mode's entry points: check the call, ask the plan, run its form (see hierarchy.h).
#include "multihost/hierarchy.h"

#include <c10/util/Exception.h>

#include <cstdio>

#include "backend/tensor_utils.h"
#include "collectives/op_desc.h"
#include "common/env.h"
#include "common/logging.h"
#include "multihost/flat.h"
#include "multihost/gloo_reduce.h"
#include "multihost/sliced.h"
#include "tuning/knobs.h"

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

// Full checks if any rank asks; the cross-host knobs must match, since they choose the route.
// Collective over the group; returns whether full checks are on.
bool agreeOnKnobs(Link& link, const tuning::Knobs& knobs) {
  auto code = [](const std::string& v, std::initializer_list<const char*> names) {
    int i = 0;
    for (const char* n : names) {
      if (v == n) return i;
      ++i;
    }
    return i;
  };
  const int algo = code(knobs.xhostAlgo, {"auto", "sliced", "flat"});
  const int comp = code(knobs.xhostCompress, {"none", "bf16", "fp16", "int8"});
  at::Tensor flags = at::tensor({link.local().fullChecks() ? 1 : 0, algo, -algo, comp, -comp}, at::kInt);
  std::vector<at::Tensor> v{flags};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp(c10d::ReduceOp::MAX);
  WaitContext ctx;
  ctx.op = "init (agreeing on mismatch checks and the cross-host knobs)";
  link.wait(link.all().allreduce(v, o), ctx);
  const int* f = flags.data_ptr<int>();
  if (f[1] != -f[2] || f[3] != -f[4]) {
    throw Error(str("tdx: the ranks of this group set TDX_XHOST_ALGO or TDX_XHOST_COMPRESS differently (this rank: ",
                    "TDX_XHOST_ALGO=", knobs.xhostAlgo, ", TDX_XHOST_COMPRESS=", knobs.xhostCompress,
                    "); give every rank the same values"));
  }
  return f[0] != 0;
}

}  // namespace

Hierarchy::Hierarchy(shm::ShmGroup& local, int rank, int size, CrossHost x)
    : link_(std::move(x.layout), rank, size, local, std::move(x.gloo), std::move(x.store), std::move(x.nodeIds),
            std::move(x.globalRanks)),
      check_(link_, agreeOnKnobs(link_, tuning::knobsFromEnv())),
      knobs_(tuning::knobsFromEnv()) {
  const HostLayout& l = link_.layout();
  group_.ranks = size;
  group_.hosts = l.numHosts;
  group_.localSize = l.localSize;
  group_.uniform = l.uniform;
  group_.amdCpu = cpuIsAmd();
  group_.singleCopyBytes = local.singleCopyBytes();
  if (!tuning::measuresLink(group_, knobs_)) return;
  WaitContext ctx;
  ctx.op = "init (measuring the host link)";
  group_.linkBytesPerSec = measureLinkRate(link_, ctx);
  if (env().debug) {
    const std::string line = str("tdx: host link measured at ", static_cast<int64_t>(group_.linkBytesPerSec / 1e6),
                                 " MB/s per direction (", l.numHosts, " hosts x ", l.localSize, " ranks): a ",
                                 tuning::fastLink(group_.linkBytesPerSec) ? "fast" : "slow",
                                 " link for TDX_XHOST_ALGO=auto\n");
    std::fprintf(stderr, "%s", line.c_str());
  }
}

tuning::Plan Hierarchy::plan(tuning::Op op, uint64_t bytes, DataType dtype, ReduceOp redop, bool equalBlocks) const {
  tuning::Call c;
  c.op = op;
  c.bytes = bytes;
  c.dtype = dtype;
  c.redop = redop;
  c.equalBlocks = equalBlocks;
  return tuning::plan(c, group_, knobs_);
}

uint64_t Hierarchy::chunkFloor() const {
  return tuning::chunkFloorBytes(group_.linkBytesPerSec, knobs_.xhostChunkBytes);
}

void Hierarchy::allreduce(const std::vector<at::Tensor>& tensors, ReduceOp op, const WaitContext& ctx, int root,
                          bool keepInputs) {
  int64_t n = 0;
  for (const auto& t : tensors) n += t.numel();
  const uint64_t bytes = static_cast<uint64_t>(n) * tensors[0].element_size();
  const DataType dt = reduceDtype("all_reduce", tensors[0].scalar_type());
  Agreement a = check_.begin(makeDesc(ctx, root >= 0 ? OpCode::kReduce : OpCode::kAllreduce, dt, bytes, root, op,
                                      true),
                             ctx);
  if (n == 0) return check_.confirm(a, ctx);
  const tuning::Plan p = plan(root >= 0 ? tuning::Op::kReduce : tuning::Op::kAllreduce, bytes, dt, op);
  const bool flatR = p.route == tuning::Route::kFlat;
  const int L = link_.layout().localSize;
  const int64_t blk = (n + L - 1) / L;
  const int slicedRoot = p.reduceAsAllreduce ? -1 : root;
  at::Tensor flat = pack(tensors, flatR ? n : blk * L);
  // One Gloo operation: over all ranks (flat), or of whole slices (one rank per host).
  const bool gloo = p.host == tuning::HostAlgo::kNone;
  // Only the sliced reduce leaves the other ranks' data as it was; the other routes write it, so
  // kept inputs are copied first unless pack() already made a copy.
  const bool writes = gloo || slicedRoot < 0;
  if (keepInputs && writes && flat.data_ptr() == tensors[0].data_ptr()) flat = flat.clone();
  if (gloo) {
    check_.confirm(a, ctx);
    GlooReduction r = startGlooAllreduce(link_, flatR ? link_.all() : link_.slice(), flat, op, p.compress,
                                         flatR ? root : -1);
    finishGlooAllreduce(link_, r, ctx);
  } else {
    SlicedAllreduceOptions o;
    o.flat = flat;
    o.blk = blk;
    o.op = op;
    o.root = slicedRoot;
    o.link = p.link;
    o.compress = p.compress;
    o.chunkFloorBytes = chunkFloor();
    slicedAllreduce(link_, check_, a, o, ctx);
  }
  if (!keepInputs) unpack(flat, tensors);
}

void Hierarchy::reduceScatter(const at::Tensor& output, const std::vector<at::Tensor>& blocks, const at::Tensor& whole,
                              ReduceOp op, const WaitContext& ctx) {
  if (!link_.sliced()) {
    // Hosts of unequal sizes: a copy of the whole input is all-reduced and this rank keeps its block.
    at::Tensor flat = at::cat(blocks);
    allreduce({flat}, op, ctx);
    const int64_t m = output.numel();
    output.copy_(flat.narrow(0, link_.rank() * m, m).view(output.sizes()));
    return;
  }
  const DataType dt = reduceDtype("reduce_scatter", output.scalar_type());
  Agreement a = check_.begin(makeDesc(ctx, OpCode::kReduceScatter, dt, output.nbytes(), -1, op, true), ctx);
  const tuning::Plan p = plan(tuning::Op::kReduceScatter, output.nbytes() * blocks.size(), dt, op);
  if (p.route == tuning::Route::kFlat) {
    check_.confirm(a, ctx);
    flatReduceScatter(link_, output, blocks, whole, op, ctx);
  } else {
    slicedReduceScatter(link_, check_, a, output, blocks, op, chunkFloor(), ctx);
  }
}

void Hierarchy::broadcast(const std::vector<at::Tensor>& tensors, int root, const WaitContext& ctx) {
  uint64_t bytes = 0;
  for (const auto& t : tensors) bytes += t.nbytes();
  Agreement a = check_.begin(makeDesc(ctx, OpCode::kBroadcast, DataType::kBytes, bytes, root), ctx);
  const tuning::Plan p = plan(tuning::Op::kBroadcast, bytes);
  if (p.route == tuning::Route::kSliced) return slicedBroadcast(link_, check_, a, tensors, root, chunkFloor(), ctx);
  // Gloo's broadcast starts before this host's ranks have compared descriptors: waiting for a late
  // host mate first put its lateness on the root's path (unshaped, 64 KB-1 MB: 0.78-0.83x Gloo's
  // own broadcast; 1.00x without the wait). The descriptors are compared while Gloo runs (host mates
  // that disagree on the root raise within one watch period, 20 ms; the group is failed then, as
  // after any mismatch) and once more when it is done.
  const shm::OpDesc desc = a.desc;
  const PendingAgree pending = a.pending;
  auto check = [&] {
    if (pending.half >= 0) link_.runLocal([&] { recheckAgree(link_.local(), pending, desc); });
  };
  flatBroadcast(link_, tensors, root, p.link, ctx, check);
  check_.confirm(a, ctx);
}

void Hierarchy::allgather(const std::vector<at::Tensor>& outputs, const at::Tensor& input, const WaitContext& ctx) {
  check_.agree(makeDesc(ctx, OpCode::kAllgather, DataType::kBytes, input.nbytes()), ctx, /*checkBytes=*/false);
  bool equal = true;
  for (const auto& o : outputs) equal = equal && o.nbytes() == input.nbytes();
  const tuning::Plan p = plan(tuning::Op::kAllgather, input.nbytes() * link_.size(), DataType::kBytes,
                              ReduceOp::kSum, equal);
  if (p.route == tuning::Route::kSliced) return slicedAllgather(link_, outputs, input, chunkFloor(), p.directGather, ctx);
  flatAllgather(link_, outputs, input, ctx);
}

void Hierarchy::gather(const std::vector<at::Tensor>& outputs, const at::Tensor& input, int root,
                       const WaitContext& ctx) {
  check_.agree(makeDesc(ctx, OpCode::kGather, DataType::kBytes, input.nbytes(), root), ctx);
  flatGather(link_, outputs, input, root, ctx);
}

void Hierarchy::scatter(const at::Tensor& output, const std::vector<at::Tensor>& inputs, int root,
                        const WaitContext& ctx) {
  check_.agree(makeDesc(ctx, OpCode::kScatter, DataType::kBytes, output.nbytes(), root), ctx);
  flatScatter(link_, output, inputs, root, ctx);
}

void Hierarchy::alltoallBytes(const at::Tensor& output, const at::Tensor& input, const std::vector<int64_t>& outBytes,
                              const std::vector<int64_t>& inBytes, const WaitContext& ctx) {
  check_.agree(makeDesc(ctx, OpCode::kAlltoall, DataType::kBytes, 0), ctx, /*checkBytes=*/false);
  flatAlltoallBytes(link_, output, input, outBytes, inBytes, ctx);
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
  check_.agree(makeDesc(ctx, OpCode::kBarrier, DataType::kBytes, 0), ctx);
  if (check_.full()) return;  // agree was a Gloo all_gather over all ranks: a barrier already
  flatBarrier(link_, ctx);
}

c10::intrusive_ptr<c10d::Work> Hierarchy::send(const at::Tensor& tensor, int dst, int tag) {
  return glooSend(link_, tensor, dst, tag);
}

c10::intrusive_ptr<c10d::Work> Hierarchy::recv(const at::Tensor& tensor, int src, int tag) {
  return glooRecv(link_, tensor, src, tag);
}

}  // namespace tdx
