// Which way a collective crosses hosts (TDX_XHOST_ALGO): the sliced algorithms
// (hierarchical_sliced.cc) or one Gloo operation over all ranks, Gloo's own algorithm.
//
// "auto" decides from measurements (docs/bench/hosts-2x2-2core.txt). Between two hosts a
// broadcast always takes the sliced form: the root's relay sends across once and each host's ranks
// get the bytes in shared memory, where the flat form sent them from the root to every rank over
// Gloo (2 x 2, alternating runs, p50 per run: 4-128 KiB 1.09x-1.91x gloo's speed sliced against
// 0.83x-1.36x flat unshaped, 4-80 KiB 1.03x-1.96x against 0.89x-1.65x at 1 Gbit/s; back to back
// 190-324 us per broadcast against 385-450 us, gloo 432-562 us). From three hosts the sliced
// broadcast is a chain of hosts (H - 1 hops), so there a broadcast below 96 KiB on a slow link, or
// below 256 KiB on a fast one, goes from the root to every rank (measured before the sliced form's
// chunks became p2p: from 96 KiB the sliced form was 1.3-1.6x quicker at 1 Gbit/s, 2.2-3.0x at
// 128-192 KiB).
// A reduce below 256 KiB runs as the sliced all_reduce (a Gloo reduce, flat or in the slices,
// takes longer than the slices' all_reduce there). On a link that carries more than kFastLink
// bytes per second the sliced forms move their data in chunks of at least 2 MiB
// (Hierarchy::chunkElems).
// all_reduce, reduce, reduce_scatter and all_gather always take the sliced form, which moves the
// fewest bytes both on the link and through memory (the sliced reduce and reduce_scatter read
// their inputs in place, where Gloo's need a copy of them; the scratch buffers are kept between
// calls). A/B runs: docs/bench/hosts-2x2-2core.txt.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>

#include "backend/hierarchical.h"
#include "common/env.h"
#include "common/logging.h"

namespace tdx {

namespace {

constexpr double kFastLink = 300e6;  // bytes per second per host link direction (1 Gbit/s: 125e6)
constexpr uint64_t kFlatBroadcastMax = 96u << 10;  // from 3 hosts, a broadcast below this on a slow link is flat
constexpr uint64_t kReduceAsAllreduceMax = 256u << 10;
constexpr uint64_t kFastBroadcastMax = 256u << 10;
constexpr int64_t kProbeBytes = 1 << 20;  // per slice group; at 1 Gbit/s twice the tc burst
constexpr int kProbeWarmups = 3, kProbeRuns = 3;

// Gloo's reduce_scatter takes these dtypes and ops (AVG as SUM, then divided).
bool glooReduceScatters(at::ScalarType dtype, ReduceOp op) {
  const bool type = dtype == at::kFloat || dtype == at::kDouble || dtype == at::kInt || dtype == at::kLong;
  return type && (op == ReduceOp::kSum || op == ReduceOp::kAvg || op == ReduceOp::kMin || op == ReduceOp::kMax ||
                  op == ReduceOp::kProduct);
}

}  // namespace

bool Hierarchy::flatRoute(OpCode op, uint64_t bytes, at::ScalarType dtype, ReduceOp redop) const {
  if (!slice_) return true;  // hosts of unequal sizes
  const bool reduction = op == OpCode::kAllreduce || op == OpCode::kReduce || op == OpCode::kReduceScatter;
  // Compression happens in the slice groups only, after the host's full-precision reduction.
  const bool compressed = reduction && compressesOnLink(dtype, redop);
  if (compressed || layout_.localSize == 1) return false;
  if (op == OpCode::kReduceScatter && !glooReduceScatters(dtype, redop)) return false;
  if (env().xhostAlgo == "sliced") return false;
  if (env().xhostAlgo == "flat") return true;
  const bool fast = fastLink();
  switch (op) {
    case OpCode::kBroadcast:
      if (layout_.numHosts == 2) return false;  // sliced: one send across, shared memory on the hosts
      return bytes < kFlatBroadcastMax || (fast && bytes < kFastBroadcastMax);
    default: return false;
  }
}

bool Hierarchy::fastLink() const { return linkBytesPerSec_ > kFastLink; }

bool Hierarchy::reduceAsAllreduce(uint64_t bytes) const {
  return env().xhostAlgo == "auto" && bytes < kReduceAsAllreduceMax;
}

void Hierarchy::measureLink(const WaitContext& ctx) {
  // Every slice group all-reduces kProbeBytes at once, as the sliced all_reduce does:
  // kProbeWarmups warm-up runs, then the quickest of kProbeRuns timed runs; the slowest rank's
  // time counts on every rank. With one warm-up and two timed runs the first group of a process
  // measured an unshaped veth at 244-280 MB/s (a slow link; later groups 875-2318 MB/s), which
  // sends a 1 MB broadcast the sliced way (docs/bench/hosts-2x2-2core.txt).
  const int H = layout_.numHosts, L = layout_.localSize;
  at::Tensor probe = at::zeros({kProbeBytes / 4}, at::kFloat);
  double best = 1e30;
  for (int i = 0; i < kProbeWarmups + kProbeRuns; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    glooAllreduce(*slice_, probe, ReduceOp::kMax, ctx);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (i >= kProbeWarmups) best = std::min(best, s);
  }
  std::vector<at::Tensor> v{at::full({1}, best, at::kDouble)};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp(c10d::ReduceOp::MAX);
  waitGloo(all_->allreduce(v, o), ctx);
  // A ring all_reduce of P bytes over H hosts sends 2(H-1)/H P per rank; L ranks share a link.
  const double linkBytes = 2.0 * (H - 1) / H * static_cast<double>(kProbeBytes) * L;
  linkBytesPerSec_ = linkBytes / std::max(v[0].item<double>(), 1e-9);
  if (env().debug) {
    const std::string line = str("tdx: host link measured at ", static_cast<int64_t>(linkBytesPerSec_ / 1e6),
                                 " MB/s per direction (", H, " hosts x ", L, " ranks): a ",
                                 fastLink() ? "fast" : "slow", " link for TDX_XHOST_ALGO=auto\n");
    std::fprintf(stderr, "%s", line.c_str());
  }
}

void Hierarchy::flatReduceScatter(const at::Tensor& output, const std::vector<at::Tensor>& blocks,
                                  const at::Tensor& whole, ReduceOp op, const WaitContext& ctx) {
  c10d::ReduceScatterOptions o;
  o.reduceOp = c10d::ReduceOp(glooOp(op));  // only ops glooReduceScatters() accepts arrive here
  at::Tensor out = output.is_contiguous() ? output.view({-1}) : at::empty({output.numel()}, output.options());
  at::Tensor in = whole.defined() ? whole : at::cat(blocks);  // Gloo reads it, never writes it
  waitGloo(all_->_reduce_scatter_base(out, in, o), ctx);
  if (op == ReduceOp::kAvg) out.div_(size_);
  if (!out.is_same(output) && out.data_ptr() != output.data_ptr()) output.copy_(out.view(output.sizes()));
}

}  // namespace tdx
