// Blockwise int8 on the host link (TDX_XHOST_COMPRESS=int8): a host's float32 partial crosses
// hosts as one packet of int8 values with a float32 scale per block of kInt8Block elements (the
// quantizer of DDP's int8 comm hook, csrc/kernels/compress_cpu.h). Every rank of a slice group
// receives the same packets and sums them dequantized in host order, so every rank gets the same
// bits (its own host's partial counts as it was quantized, like the others).
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace tdx {

// Bytes of the packet for n float32 elements: the scales (4 bytes per block), then n int8 values.
int64_t int8PacketBytes(int64_t n);

// Quantizes the contiguous float32 tensor `x` into a new byte tensor (the packet).
at::Tensor int8Pack(const at::Tensor& x);

// out = the sum of the dequantized packets, folded in their order (out: contiguous float32 with
// the packets' element count; each packet from int8Pack of that many elements).
void int8SumPackets(const std::vector<at::Tensor>& packets, const at::Tensor& out);

}  // namespace tdx
