// The sliced all_gather across hosts (see sliced.h).
#include <algorithm>

#include "backend/tensor_utils.h"
#include "collectives/collectives.h"
#include "multihost/sliced.h"

namespace tdx {

void slicedAllgather(Link& link, const std::vector<at::Tensor>& outputs, const at::Tensor& input,
                     uint64_t chunkFloorBytes, bool direct, const WaitContext& ctx) {
  const HostLayout& layout = link.layout();
  const int H = layout.numHosts, L = layout.localSize;
  Staged in(input);
  at::Tensor inBytes = bytesOf(in.tensor());
  const int64_t b = inBytes.numel(), chunk = tuning::chunkElems(chunkFloorBytes, 1, b);
  std::vector<Staged> outs = stageAll(outputs, /*copyIn=*/false);
  // Chunk [off, off + len) of the output of the rank with local index p on host h.
  auto outChunk = [&](int h, int p, int64_t off, int64_t len) {
    return bytesOf(outs[layout.hostRanks[h][p]].tensor()).narrow(0, off, len);
  };
  // Across hosts, hostBuf gets [H * off, H * (off + len)) = that chunk of the rank with this local
  // index on each host, in host order (with one rank per host, Gloo writes the outputs directly).
  // On the host, `direct`: each host's part of the chunk is gathered from hostBuf straight into the
  // outputs (one shared-memory all_gather per host); else the whole chunk is gathered into a
  // buffer in rank order at once and copied out (one synchronization instead of H). Every chunk's
  // Gloo all_gather is started first; each chunk is then gathered on the host as soon as it has
  // arrived.
  at::Tensor hostBuf = L > 1 ? link.scratch(0, H * b, at::kByte) : at::Tensor();
  at::Tensor all = L > 1 && !direct ? link.scratch(1, L * H * b, at::kByte) : at::Tensor();
  std::vector<GlooWork> works;
  for (int64_t off = 0; off < b; off += chunk) {
    const int64_t len = std::min(chunk, b - off);
    std::vector<std::vector<at::Tensor>> ov(1);
    for (int h = 0; h < H; ++h) {
      ov[0].push_back(L > 1 ? hostBuf.narrow(0, H * off + h * len, len) : outChunk(h, 0, off, len));
    }
    std::vector<at::Tensor> iv{inBytes.narrow(0, off, len)};
    works.push_back(link.slice().allgather(ov, iv));
  }
  for (int64_t off = 0, i = 0; off < b; off += chunk, ++i) {
    const int64_t len = std::min(chunk, b - off);
    link.wait(works[i], ctx);
    if (L > 1 && !direct) {
      AllgatherOptions ag;
      ag.in = spanOf(hostBuf, H * off, H * len);
      for (int p = 0; p < L; ++p) ag.out.push_back(spanOf(all, p * H * b + H * off, H * len));
      link.runLocal([&] { tdx::allgather(link.local(), ag, ctx); });
      for (int p = 0; p < L; ++p) {
        for (int h = 0; h < H; ++h) outChunk(h, p, off, len).copy_(all.narrow(0, p * H * b + H * off + h * len, len));
      }
      continue;
    }
    for (int h = 0; h < H && L > 1; ++h) {
      AllgatherOptions ag;
      ag.in = spanOf(hostBuf, H * off + h * len, len);
      for (int p = 0; p < L; ++p) ag.out.push_back(spanOf(outChunk(h, p, off, len), 0, len));
      link.runLocal([&] { tdx::allgather(link.local(), ag, ctx); });
    }
  }
  finishAll(outs);
}

}  // namespace tdx
