#include "tensor_parallel/comm_ops.h"

#include <atomic>

#include <torch/csrc/autograd/custom_function.h>

namespace tdx::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

std::atomic<int64_t> bytes_{0};

void count(const at::Tensor& t) { bytes_ += static_cast<int64_t>(t.numel() * t.element_size()); }

Group groupOf(AutogradContext* ctx) { return ctx->saved_data["group"].toCustomClass<c10d::ProcessGroup>(); }

at::Tensor allReduce(const at::Tensor& x, const Group& g) {
  std::vector<at::Tensor> t{x.contiguous().clone()};
  count(t[0]);
  g->allreduce(t)->wait();
  return t[0];
}

// Runs a flat collective `run(out, in)` along `dim` (moved to the front); the output's first
// dimension is the input's times num / den.
template <typename Run>
at::Tensor alongDim(const at::Tensor& x, int64_t dim, int64_t num, int64_t den, Run run) {
  at::Tensor in = x.movedim(dim, 0).contiguous();
  auto sizes = in.sizes().vec();
  sizes[0] = sizes[0] * num / den;
  at::Tensor out = at::empty(sizes, in.options());
  count(in);
  run(out, in);
  return out.movedim(0, dim);
}

at::Tensor allGather(const at::Tensor& x, const Group& g, int64_t dim) {
  return alongDim(x, dim, g->getSize(), 1,
                  [&](at::Tensor& out, at::Tensor& in) { g->_allgather_base(out, in)->wait(); });
}

at::Tensor reduceScatter(const at::Tensor& x, const Group& g, int64_t dim) {
  const int64_t n = g->getSize();
  TORCH_CHECK(x.size(dim) % n == 0, "reduce_scatter_seq: dim ", dim, " of size ", x.size(dim),
              " is not divisible by the tensor-parallel degree ", n, "; pad the sequence to a multiple of ", n);
  return alongDim(x, dim, 1, n,
                  [&](at::Tensor& out, at::Tensor& in) { g->_reduce_scatter_base(out, in)->wait(); });
}

at::Tensor split(const at::Tensor& x, const Group& g, int64_t dim) {
  const int64_t n = g->getSize();
  TORCH_CHECK(x.size(dim) % n == 0, "split: dim ", dim, " of size ", x.size(dim),
              " is not divisible by the tensor-parallel degree ", n);
  return x.chunk(n, dim)[g->getRank()].contiguous();
}

struct CopyToRegion : torch::autograd::Function<CopyToRegion> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const Group& g) {
    ctx->saved_data["group"] = g;
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {allReduce(grads[0], groupOf(ctx)), at::Tensor()};
  }
};

struct ReduceFromRegion : torch::autograd::Function<ReduceFromRegion> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x, const Group& g) { return allReduce(x, g); }
  static variable_list backward(AutogradContext*, variable_list grads) { return {grads[0], at::Tensor()}; }
};

struct GatherDim : torch::autograd::Function<GatherDim> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const Group& g, int64_t dim, bool reduceGrad) {
    ctx->saved_data["group"] = g;
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["reduce"] = reduceGrad;
    return allGather(x, g, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t dim = ctx->saved_data["dim"].toInt();
    const Group g = groupOf(ctx);
    at::Tensor gx = ctx->saved_data["reduce"].toBool() ? reduceScatter(grads[0], g, dim) : split(grads[0], g, dim);
    return {gx, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Split (isReduce false) or reduce-scatter (true) forward; all-gather backward.
struct ShardDim : torch::autograd::Function<ShardDim> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const Group& g, int64_t dim, bool isReduce) {
    ctx->saved_data["group"] = g;
    ctx->saved_data["dim"] = dim;
    return isReduce ? reduceScatter(x, g, dim) : split(x, g, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {allGather(grads[0], groupOf(ctx), ctx->saved_data["dim"].toInt()), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

int64_t wrapDim(const at::Tensor& x, int64_t dim, const char* op) {
  const int64_t d = x.dim();
  TORCH_CHECK(dim >= -d && dim < d, op, ": dim ", dim, " is out of range for a tensor of ", d, " dims");
  return dim < 0 ? dim + d : dim;
}

}  // namespace

at::Tensor copyToRegion(const at::Tensor& x, const Group& group) { return CopyToRegion::apply(x, group); }
at::Tensor reduceFromRegion(const at::Tensor& x, const Group& group) { return ReduceFromRegion::apply(x, group); }
at::Tensor gatherDim(const at::Tensor& x, const Group& group, int64_t dim, bool reduceGrad) {
  return GatherDim::apply(x, group, wrapDim(x, dim, "gather"), reduceGrad);
}
at::Tensor scatterDim(const at::Tensor& x, const Group& group, int64_t dim) {
  return ShardDim::apply(x, group, wrapDim(x, dim, "scatter"), false);
}
at::Tensor reduceScatterDim(const at::Tensor& x, const Group& group, int64_t dim) {
  return ShardDim::apply(x, group, wrapDim(x, dim, "reduce_scatter"), true);
}
int64_t bytesCommunicated() { return bytes_.load(); }
void resetBytesCommunicated() { bytes_ = 0; }

}  // namespace tdx::tp
