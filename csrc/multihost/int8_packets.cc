// Blockwise int8 packets for the host link (see int8_packets.h).
#include "multihost/int8_packets.h"

#include <c10/util/Exception.h>

#include "kernels/compress_cpu.h"

namespace tdx {

using kernels::int8NumBlocks;
using kernels::kInt8Block;

int64_t int8PacketBytes(int64_t n) {
  return int8NumBlocks(n) * static_cast<int64_t>(sizeof(float)) + n;
}

at::Tensor int8Pack(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "tdx internal error: int8Pack takes contiguous float32");
  const int64_t n = x.numel();
  at::Tensor packet = at::empty({int8PacketBytes(n)}, at::kByte);
  auto* scales = reinterpret_cast<float*>(packet.data_ptr());  // at offset 0: aligned
  auto* q = reinterpret_cast<int8_t*>(packet.data_ptr<uint8_t>() + int8NumBlocks(n) * sizeof(float));
  kernels::int8BlockQuantize(x.data_ptr<float>(), n, kInt8Block, q, scales);
  return packet;
}

void int8SumPackets(const std::vector<at::Tensor>& packets, const at::Tensor& out) {
  const int64_t n = out.numel();
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && !packets.empty(),
              "tdx internal error: int8SumPackets takes contiguous float32 and at least one packet");
  float* o = out.data_ptr<float>();
  for (size_t h = 0; h < packets.size(); ++h) {
    TORCH_CHECK(packets[h].numel() == int8PacketBytes(n), "tdx internal error: an int8 packet of ",
                packets[h].numel(), " bytes for ", n, " elements");
    const auto* scales = reinterpret_cast<const float*>(packets[h].data_ptr());
    const auto* q = reinterpret_cast<const int8_t*>(packets[h].data_ptr<uint8_t>() + int8NumBlocks(n) * sizeof(float));
    if (h == 0) {
      kernels::int8BlockDequantize(q, scales, n, kInt8Block, o);
    } else {
      kernels::int8BlockDequantizeAdd(q, scales, n, kInt8Block, o);
    }
  }
}

}  // namespace tdx
