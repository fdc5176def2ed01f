// The flat forms across hosts (see flat.h).
#include "multihost/flat.h"

#include <c10/util/Exception.h>

#include "backend/tensor_utils.h"
#include "collectives/collectives.h"
#include "multihost/gloo_reduce.h"

namespace tdx {

void flatBroadcast(Link& link, const std::vector<at::Tensor>& tensors, int root, tuning::LinkAlgo how,
                   const WaitContext& ctx, const std::function<void()>& check) {
  const int rank = link.rank(), size = link.size();
  if (how == tuning::LinkAlgo::kP2PFromRoot) {
    const HostLayout& layout = link.layout();
    const int rootHost = layout.placeOf(root).first;
    std::vector<Staged> staged = stageAll(tensors, /*copyIn=*/rank == root);
    std::vector<GlooWork> works;
    link.post(works, [&] {
      for (const auto& s : staged) {
        if (s.bytes() == 0) continue;
        std::vector<at::Tensor> v{bytesOf(s.tensor())};
        if (rank != root) {
          works.push_back(link.all().recv(v, root, kBroadcastTag));
          continue;
        }
        for (int i = 1; i < size; ++i) {  // the next ranks first: other hosts' before the root's mates
          const int r = (root + i) % size;
          if (layout.placeOf(r).first != rootHost) works.push_back(link.all().send(v, r, kBroadcastTag));
        }
        for (int r : layout.localRanks) {
          if (r != root) works.push_back(link.all().send(v, r, kBroadcastTag));
        }
      }
    }, ctx);
    if (!works.empty()) link.wait(works, ctx, check);
    if (rank != root) finishAll(staged);
    return;
  }
  for (const auto& t : tensors) {
    Staged s(t, /*copyIn=*/rank == root);
    std::vector<at::Tensor> v{bytesOf(s.tensor())};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    link.wait(link.all().broadcast(v, o), ctx, check);
    if (rank != root) s.finish();
  }
}

void flatAllgather(Link& link, const std::vector<at::Tensor>& outputs, const at::Tensor& input,
                   const WaitContext& ctx) {
  Staged in(input);
  std::vector<Staged> outs = stageAll(outputs, /*copyIn=*/false);
  bool even = true;
  for (const auto& o : outs) even = even && o.bytes() == in.bytes();
  if (even) {
    std::vector<std::vector<at::Tensor>> ov(1);
    for (const auto& o : outs) ov[0].push_back(bytesOf(o.tensor()));
    std::vector<at::Tensor> iv{bytesOf(in.tensor())};
    link.wait(link.all().allgather(ov, iv), ctx);
  } else {
    // Gloo's all_gather needs equal sizes: each rank broadcasts its block in turn.
    for (int p = 0; p < link.size(); ++p) {
      at::Tensor b = bytesOf(outs[p].tensor());
      if (p == link.rank()) b.copy_(bytesOf(in.tensor()));
      std::vector<at::Tensor> v{b};
      c10d::BroadcastOptions o;
      o.rootRank = p;
      link.wait(link.all().broadcast(v, o), ctx);
    }
  }
  finishAll(outs);
}

void flatGather(Link& link, const std::vector<at::Tensor>& outputs, const at::Tensor& input, int root,
                const WaitContext& ctx) {
  Staged in(input);
  std::vector<Staged> outs = stageAll(outputs, /*copyIn=*/false);
  std::vector<std::vector<at::Tensor>> ov;
  if (link.rank() == root) {
    ov.emplace_back();
    for (const auto& o : outs) ov[0].push_back(bytesOf(o.tensor()));
  }
  std::vector<at::Tensor> iv{bytesOf(in.tensor())};
  c10d::GatherOptions o;
  o.rootRank = root;
  link.wait(link.all().gather(ov, iv, o), ctx);
  finishAll(outs);
}

void flatScatter(Link& link, const at::Tensor& output, const std::vector<at::Tensor>& inputs, int root,
                 const WaitContext& ctx) {
  Staged out(output, /*copyIn=*/false);
  std::vector<Staged> ins = stageAll(inputs);
  std::vector<std::vector<at::Tensor>> iv;
  if (link.rank() == root) {
    iv.emplace_back();
    for (const auto& i : ins) iv[0].push_back(bytesOf(i.tensor()));
  }
  std::vector<at::Tensor> ov{bytesOf(out.tensor())};
  c10d::ScatterOptions o;
  o.rootRank = root;
  link.wait(link.all().scatter(ov, iv, o), ctx);
  out.finish();
}

void flatAlltoallBytes(Link& link, const at::Tensor& output, const at::Tensor& input,
                       const std::vector<int64_t>& outBytes, const std::vector<int64_t>& inBytes,
                       const WaitContext& ctx) {
  Staged in(input);
  Staged out(output, /*copyIn=*/false);
  at::Tensor ob = bytesOf(out.tensor()), ib = bytesOf(in.tensor());
  std::vector<int64_t> os = outBytes, is = inBytes;
  link.wait(link.all().alltoall_base(ob, ib, os, is), ctx);
  out.finish();
}

void flatReduceScatter(Link& link, const at::Tensor& output, const std::vector<at::Tensor>& blocks,
                       const at::Tensor& whole, ReduceOp op, const WaitContext& ctx) {
  c10d::ReduceScatterOptions o;
  o.reduceOp = c10d::ReduceOp(glooOp(op));  // only the ops the plan lets through arrive here
  at::Tensor out = output.is_contiguous() ? output.view({-1}) : at::empty({output.numel()}, output.options());
  at::Tensor in = whole.defined() ? whole : at::cat(blocks);  // Gloo reads it, never writes it
  link.wait(link.all()._reduce_scatter_base(out, in, o), ctx);
  if (op == ReduceOp::kAvg) out.div_(link.size());
  if (!out.is_same(output) && out.data_ptr() != output.data_ptr()) output.copy_(out.view(output.sizes()));
}

void flatBarrier(Link& link, const WaitContext& ctx) {
  // Gloo's barrier over all ranks, through its worker thread, took 1.55-1.85 ms at 2 x 2 simulated
  // hosts against gloo's 1.18-1.23 ms and released the ranks up to 1.9 ms apart
  // (scripts/probe_simhosts.py barrier).
  const HostLayout& layout = link.layout();
  if (layout.localRanks[0] == link.rank()) {
    const int H = layout.numHosts;
    at::Tensor heard = at::empty({H}, at::kByte), told = at::zeros({1}, at::kByte);
    std::vector<GlooWork> works;
    link.post(works, [&] {
      for (int h = 0; h < H; ++h) {
        if (h == layout.hostIndex) continue;
        std::vector<at::Tensor> r{heard.narrow(0, h, 1)};
        works.push_back(link.all().recv(r, layout.hostRanks[h][0], kBarrierTag));
      }
      for (int h = 0; h < H; ++h) {
        if (h == layout.hostIndex) continue;
        std::vector<at::Tensor> v{told};
        works.push_back(link.all().send(v, layout.hostRanks[h][0], kBarrierTag));
      }
    }, ctx);
    link.wait(works, ctx);
  }
  if (link.local().size() > 1) {
    // A little past the operation's deadline: a first rank's failure across hosts (its own deadline)
    // then reaches its host mates as its cause, not as a rank that did not arrive.
    WaitContext release = ctx;
    if (ctx.timeout.count() > 0) release.deadline += std::chrono::seconds(2);
    link.runLocal([&] { tdx::barrier(link.local(), release); });
  }
}

}  // namespace tdx
