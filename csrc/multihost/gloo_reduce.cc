#include "multihost/gloo_reduce.h"

#include <algorithm>
#include <chrono>

#include "backend/tensor_utils.h"
#include "collectives/reduce_kernels.h"
#include "common/logging.h"
#include "multihost/int8_packets.h"

namespace tdx {

namespace {
constexpr int64_t kProbeBytes = 1 << 20;  // per slice group; at 1 Gbit/s twice the tc burst
// With one warm-up and two timed runs the first group of a process measured an unshaped veth at
// 244-280 MB/s (a slow link; later groups 875-2318 MB/s), which sends a 1 MB broadcast the sliced
// way (docs/bench/hosts-2x2-2core.txt).
constexpr int kProbeWarmups = 3, kProbeRuns = 3;
}  // namespace

c10d::ReduceOp::RedOpType glooOp(ReduceOp op) {
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

GlooReduction startGlooAllreduce(Link& link, c10d::Backend& pg, const at::Tensor& flat, ReduceOp op,
                                 const std::string& compress, int root) {
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
  } else if (compress == "int8") {
    // Blockwise int8: every host's packet goes to every host, which sums them in host order.
    at::Tensor packet = int8Pack(flat);
    std::vector<std::vector<at::Tensor>> ov(1);
    for (int h = 0; h < link.layout().numHosts; ++h) ov[0].push_back(at::empty_like(packet));
    std::vector<at::Tensor> iv{packet};
    auto work = pg.allgather(ov, iv);
    return GlooReduction{work, flat, packet, op, ov[0]};
  } else if (compress == "bf16" || compress == "fp16") {
    // Half the bytes on the host links; Gloo's result is the same on every rank.
    t = flat.to(compress == "bf16" ? at::kBFloat16 : at::kHalf);
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

GlooReduction startSliceExchange(Link& link, const at::Tensor& flat, const at::Tensor& partials, ReduceOp op,
                                 DataType dt) {
  // Being a collective, its wait still watches the host mates.
  const int H = link.layout().numHosts;
  TDX_CHECK_EQ(partials.numel(), flat.numel() * H);
  GlooReduction r;
  r.flat = flat;
  r.sent = flat;
  r.op = op;
  r.dt = dt;
  // As bytes, so every dtype moves (Gloo's all_gather refuses some, bool and int16 among them).
  std::vector<std::vector<at::Tensor>> ov(1);
  for (int h = 0; h < H; ++h) {
    r.partials.push_back(partials.narrow(0, h * flat.numel(), flat.numel()));
    ov[0].push_back(bytesOf(r.partials.back()));
  }
  std::vector<at::Tensor> iv{bytesOf(flat)};
  r.work = link.slice().allgather(ov, iv);
  return r;
}

void finishGlooAllreduce(Link& link, GlooReduction& r, const WaitContext& ctx) {
  link.wait(r.work, ctx);
  if (!r.partials.empty()) {
    std::vector<const void*> parts;
    for (const auto& p : r.partials) parts.push_back(p.data_ptr());
    const ReduceOp op = r.op == ReduceOp::kAvg ? ReduceOp::kSum : r.op;
    reduceInto(r.flat.data_ptr(), parts.data(), static_cast<int>(parts.size()), static_cast<size_t>(r.flat.numel()),
               r.dt, op);
    if (r.op == ReduceOp::kAvg) r.flat.div_(link.size());
    return;
  }
  if (!r.packets.empty()) {
    int8SumPackets(r.packets, r.flat);
  } else if (!r.sent.is_same(r.flat) && r.flat.scalar_type() != at::kBool) {
    r.flat.copy_(r.sent);
  }
  if (r.op == ReduceOp::kAvg) r.flat.div_(link.size());
}

double measureLinkRate(Link& link, const WaitContext& ctx) {
  // kProbeWarmups warm-up runs, then the quickest of kProbeRuns timed runs.
  const int H = link.layout().numHosts, L = link.layout().localSize;
  at::Tensor probe = at::zeros({kProbeBytes / 4}, at::kFloat);
  double best = 1e30;
  for (int i = 0; i < kProbeWarmups + kProbeRuns; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    GlooReduction r = startGlooAllreduce(link, link.slice(), probe, ReduceOp::kMax, "none");
    finishGlooAllreduce(link, r, ctx);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (i >= kProbeWarmups) best = std::min(best, s);
  }
  std::vector<at::Tensor> v{at::full({1}, best, at::kDouble)};
  c10d::AllreduceOptions o;
  o.reduceOp = c10d::ReduceOp(c10d::ReduceOp::MAX);
  link.wait(link.all().allreduce(v, o), ctx);
  // A ring all_reduce of P bytes over H hosts sends 2(H-1)/H P per rank; L ranks share a link.
  const double linkBytes = 2.0 * (H - 1) / H * static_cast<double>(kProbeBytes) * L;
  return linkBytes / std::max(v[0].item<double>(), 1e-9);
}

}  // namespace tdx
