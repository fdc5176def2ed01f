// The torch-facing part of the sharding core: flat tensors built from parameters, and parameter
// views into a flat tensor (autograd-aware: gradients of the views flow back into the flat one).
#pragma once

#include <torch/extension.h>

#include <vector>

#include "sharding/flat_layout.h"

namespace tdx {

// A new zero-filled tensor of layout.paddedNumel elements (dtype/device from `options`) holding
// every parameter at its offset. TORCH_CHECKs that each parameter's numel matches the layout.
at::Tensor flattenParams(const std::vector<at::Tensor>& params, const FlatLayout& layout,
                         const at::TensorOptions& options);

// Views of `flat` (1-D, paddedNumel elements) shaped as `shapes`, one per parameter, made with a
// single split_with_sizes so autograd sums their gradients into flat's gradient in one node.
std::vector<at::Tensor> paramViews(const at::Tensor& flat, const FlatLayout& layout,
                                   const std::vector<std::vector<int64_t>>& shapes);

}  // namespace tdx
