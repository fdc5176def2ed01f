#include "sharding/flat_views.h"

namespace tdx {

at::Tensor flattenParams(const std::vector<at::Tensor>& params, const FlatLayout& layout,
                         const at::TensorOptions& options) {
  TORCH_CHECK(params.size() == layout.numels.size(), "flatten_params: got ", params.size(),
              " parameters but the layout has ", layout.numels.size());
  at::Tensor flat = at::zeros({layout.paddedNumel}, options);
  at::NoGradGuard noGrad;
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_CHECK(params[i].numel() == layout.numels[i], "flatten_params: parameter ", i, " has ", params[i].numel(),
                " elements but the layout expects ", layout.numels[i]);
    flat.narrow(0, layout.offsets[i], layout.numels[i]).copy_(params[i].reshape({-1}));
  }
  return flat;
}

std::vector<at::Tensor> paramViews(const at::Tensor& flat, const FlatLayout& layout,
                                   const std::vector<std::vector<int64_t>>& shapes) {
  TORCH_CHECK(flat.dim() == 1 && flat.numel() == layout.paddedNumel, "param_views: the flat tensor has shape ",
              flat.sizes(), " but the layout needs [", layout.paddedNumel, "]");
  TORCH_CHECK(shapes.size() == layout.numels.size(), "param_views: got ", shapes.size(),
              " shapes but the layout has ", layout.numels.size(), " parameters");
  std::vector<int64_t> sizes = splitSizes(layout);
  std::vector<at::Tensor> pieces = at::split_with_sizes(flat, sizes);
  std::vector<at::Tensor> views;
  views.reserve(shapes.size());
  for (size_t i = 0; i < shapes.size(); ++i) views.push_back(pieces[2 * i].view(shapes[i]));
  return views;
}

}  // namespace tdx
