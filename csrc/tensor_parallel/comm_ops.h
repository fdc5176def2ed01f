// Tensor-parallel communication operators as autograd functions over a c10d process group.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

namespace tdx::tp {

using Group = c10::intrusive_ptr<c10d::ProcessGroup>;

// Identity forward; all-reduce (sum) of the gradient in backward.
at::Tensor copyToRegion(const at::Tensor& x, const Group& group);
// All-reduce (sum) forward; identity backward.
at::Tensor reduceFromRegion(const at::Tensor& x, const Group& group);
// All-gather along `dim` forward; backward reduce-scatters (reduceGrad) or keeps this rank's slice.
at::Tensor gatherDim(const at::Tensor& x, const Group& group, int64_t dim, bool reduceGrad);
// This rank's chunk along `dim` forward; all-gather of the gradient in backward.
at::Tensor scatterDim(const at::Tensor& x, const Group& group, int64_t dim);
// Reduce-scatter (sum) along `dim` forward; all-gather of the gradient in backward.
at::Tensor reduceScatterDim(const at::Tensor& x, const Group& group, int64_t dim);
// Payload bytes these operators have handed to collectives in this process (forward and backward).
int64_t bytesCommunicated();
void resetBytesCommunicated();

}  // namespace tdx::tp
