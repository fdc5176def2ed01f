// The sliced reduce_scatter across hosts (see sliced.h).
#include <algorithm>

#include "backend/tensor_utils.h"
#include "collectives/collectives.h"
#include "collectives/reduce_kernels.h"
#include "multihost/sliced.h"

namespace tdx {

void slicedReduceScatter(Link& link, MismatchCheck& check, Agreement& a, const at::Tensor& output,
                         const std::vector<at::Tensor>& blocks, ReduceOp op, uint64_t chunkFloorBytes,
                         const WaitContext& ctx) {
  const HostLayout& layout = link.layout();
  const int H = layout.numHosts, L = layout.localSize, me = layout.hostIndex;
  const int64_t m = output.numel(), chunk = tuning::chunkElems(chunkFloorBytes, output.element_size(), m);
  const DataType dt = reduceDtype("reduce_scatter", output.scalar_type());
  const ReduceOp sumOp = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
  // Chunk [off, off + len) of the blocks of host h's ranks: this host's ranks reduce-scatter it
  // straight from their inputs, so local rank p gets this host's partial of rank (h, p)'s chunk,
  // in partial[h]; it goes to host h, and fromHosts[h] gets host h's partial of this rank's chunk
  // (each byte crosses once). The other hosts' chunks go first, so the link starts early. With one
  // rank per host the partial is the input block itself.
  at::Tensor partial = L > 1 ? link.scratch(0, H * m, output.scalar_type()) : at::Tensor();
  at::Tensor fromHosts = link.scratch(1, H * m, output.scalar_type());
  auto partialOf = [&](int h, int64_t off, int64_t len) {
    return L > 1 ? partial.narrow(0, h * m + off, len) : blocks[layout.hostRanks[h][0]].narrow(0, off, len);
  };
  std::vector<GlooWork> works;
  int tag = 0;
  for (int64_t off = 0; off < m; off += chunk, ++tag) {
    const int64_t len = std::min(chunk, m - off);
    for (int step = 1; step <= H; ++step) {
      const int h = (me + step) % H;
      if (L > 1) {
        ReduceScatterOptions rs;
        for (int p = 0; p < L; ++p) rs.in.push_back(spanOf(blocks[layout.hostRanks[h][p]], off, len));
        rs.out = spanOf(partial, h * m + off, len);
        rs.dtype = dt;
        rs.op = sumOp;
        check.runFirstLocal(a, [&] { tdx::reduceScatter(link.local(), rs, ctx); }, ctx);  // the check rides on the first
      }
      if (h == me) continue;
      std::vector<at::Tensor> s{partialOf(h, off, len)}, r{fromHosts.narrow(0, h * m + off, len)};
      works.push_back(link.slice().send(s, h, tag));
      works.push_back(link.slice().recv(r, h, tag));
    }
  }
  check.confirm(a, ctx);  // empty blocks: no step carried the check
  for (auto& w : works) link.wait(w, ctx);
  std::vector<const void*> parts;
  for (int h = 0; h < H; ++h) {
    parts.push_back(h == me ? partialOf(me, 0, m).data_ptr() : fromHosts.narrow(0, h * m, m).data_ptr());
  }
  at::Tensor result = output.is_contiguous() ? output.view({-1}) : at::empty({m}, output.options());
  reduceInto(result.data_ptr(), parts.data(), H, static_cast<size_t>(m), dt, sumOp);
  if (op == ReduceOp::kAvg) result.div_(link.size());
  if (result.data_ptr() != output.data_ptr()) output.copy_(result.view(output.sizes()));
}

}  // namespace tdx
