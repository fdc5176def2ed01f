#include "reducer/reducer.h"

#include <ATen/ScalarOps.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include <c10/util/Exception.h>

#include <cstdlib>
#include <sstream>
#include <unordered_set>

#include "common/env.h"
#include "reducer/bucket_assignment.h"

namespace tdx {

using torch::autograd::Node;
using torch::autograd::variable_list;

Reducer::Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
                 c10::intrusive_ptr<c10d::ProcessGroup> pg, ReducerOptions opts)
    : params_(std::move(params)),
      names_(std::move(names)),
      pg_(std::move(pg)),
      opts_(opts),
      divFactor_(pg_->getSize()) {
  TORCH_CHECK_VALUE(!params_.empty(), "DistributedDataParallel: the module has no parameter that requires grad");
  TORCH_CHECK_VALUE(names_.size() == params_.size(), "DistributedDataParallel: ", names_.size(), " names for ",
                    params_.size(), " parameters");
  std::unordered_set<const void*> seen;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    TORCH_CHECK_VALUE(p.requires_grad(), "DistributedDataParallel: parameter ", names_[i], " does not require grad");
    TORCH_CHECK_VALUE(p.layout() == at::kStrided && p.is_contiguous(), "DistributedDataParallel: parameter ",
                      names_[i], " must be a dense contiguous tensor");
    TORCH_CHECK_VALUE(seen.insert(p.unsafeGetTensorImpl()).second, "DistributedDataParallel: parameter ", names_[i],
                      " is listed twice");
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
    uintptr_t key = acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, i](const variable_list& outputs, const variable_list& /*inputs*/) {
          autogradHook(i);
          return outputs;
        }));
    hooks_.emplace_back(std::move(acc), key);
  }
  if (ddpDirect()) {  // TDX_DDP_DIRECT=0: always reduce through a flat bucket
    try {
      auto be = pg_->getBackend(c10::DeviceType::CPU);
      if (be && be->getBackendName() == "tdx") premulBackend_ = be;
    } catch (const std::exception&) {
      // no CPU backend in this group (e.g. nccl only): plain buckets
    }
  }
  std::vector<size_t> order;
  for (size_t i = params_.size(); i-- > 0;) order.push_back(i);  // reverse registration order
  buildBuckets(order);
  ready_.assign(params_.size(), false);
  locallyUsed_.assign(params_.size(), false);
  hookCounts_.assign(params_.size(), 0);
  remaining_.assign(params_.size(), 0);
  staticUsed_.assign(params_.size(), true);
}

Reducer::~Reducer() { removeHooks(); }

void Reducer::removeHooks() {
  for (auto& [node, key] : hooks_) node->del_post_hook(key);
  hooks_.clear();
}

void Reducer::buildBuckets(const std::vector<size_t>& order) {
  std::vector<BucketParam> bp;
  for (const auto& p : params_) {
    bp.push_back(BucketParam{static_cast<size_t>(p.numel()) * p.element_size(),
                             std::string(c10::toString(p.scalar_type())) + "/" + p.device().str()});
  }
  auto assignment = assignBuckets(bp, order, opts_.firstBucketBytes, opts_.bucketBytes);
  buckets_.clear();
  where_.assign(params_.size(), {0, 0});
  for (auto& members : assignment) {
    Bucket b;
    b.params = members;
    int64_t total = 0;
    for (size_t i : members) {
      b.offsets.push_back(static_cast<size_t>(total));
      b.lengths.push_back(static_cast<size_t>(params_[i].numel()));
      b.sizes.push_back(params_[i].sizes());
      total += params_[i].numel();
    }
    b.numel = total;
    b.options = params_[members[0]].options().requires_grad(false);
    b.direct = premulBackend_ && !hook_ && !opts_.gradientAsBucketView && b.options.device().is_cpu() &&
               at::isFloatingType(c10::typeMetaToScalarType(b.options.dtype()));
    b.slots.resize(members.size());
    b.inGrad.assign(members.size(), false);
    for (size_t k = 0; k < members.size(); ++k) where_[members[k]] = {buckets_.size(), k};
    // A direct bucket needs its flat tensor only for a parameter without a usable gradient; it is
    // allocated then (most steps never do), which saves a copy of the gradients' size.
    if (!b.direct) ensureFlat(b);
    for (size_t k = 0; opts_.gradientAsBucketView && k < members.size(); ++k) {
      at::Tensor& p = params_[members[k]];
      if (p.grad().defined()) {
        b.views[k].copy_(p.grad());
        p.mutable_grad() = b.views[k];
      }
    }
    buckets_.push_back(std::move(b));
  }
}

void Reducer::ensureFlat(Bucket& b) {
  if (b.flat.defined()) return;
  b.flat = at::zeros({b.numel}, b.options);
  b.views.clear();
  for (size_t k = 0; k < b.params.size(); ++k) {
    const at::Tensor& p = params_[b.params[k]];
    b.views.push_back(b.flat.narrow(0, static_cast<int64_t>(b.offsets[k]), p.numel()).view(p.sizes()));
  }
}

std::vector<std::vector<size_t>> Reducer::bucketIndices() const {
  std::vector<std::vector<size_t>> out;
  for (const auto& b : buckets_) out.push_back(b.params);
  return out;
}

void Reducer::setDivideFactor(int64_t factor) {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK_VALUE(factor >= 0 && factor <= pg_->getSize(), "DistributedDataParallel: divide factor ", factor,
                    " is out of range for a group of ", pg_->getSize(), " ranks");
  divFactor_ = factor == 0 ? pg_->getSize() : factor;
}

bool Reducer::rebuildBucketsIfDue() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!rebuildDue() || expectBackward_) return false;
  rebuildFromObservedOrder();
  return true;
}

int64_t Reducer::bucketBytesAllocated() const {
  int64_t n = 0;
  for (const auto& b : buckets_) n += b.flat.defined() ? static_cast<int64_t>(b.flat.nbytes()) : 0;
  return n;
}

std::vector<bool> Reducer::directBuckets() const {
  std::vector<bool> out;
  for (const auto& b : buckets_) out.push_back(b.direct);
  return out;
}

void Reducer::prepareForBackward(const std::vector<at::Tensor>& outputs) {
  std::lock_guard<std::mutex> lock(mu_);
  if (rebuildDue()) rebuildFromObservedOrder();
  nextBucket_ = 0;
  callbackQueued_ = false;
  std::fill(ready_.begin(), ready_.end(), false);
  std::fill(locallyUsed_.begin(), locallyUsed_.end(), false);
  for (auto& b : buckets_) {
    b.pending = b.params.size();
    b.work.reset();
    b.inflight.reset();
  }
  expectBackward_ = true;
  if (opts_.staticGraph) {
    if (iterations_ == 0) return;  // the first iteration only counts hook calls
    remaining_ = hookCounts_;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (hookCounts_[i] == 0) markReady(i, /*used=*/false);  // unused in the recorded graph
    }
    return;
  }
  if (!opts_.findUnusedParameters) return;
  // Parameters whose accumulators the outputs cannot reach get no gradient this iteration.
  std::unordered_set<Node*> reached;
  std::vector<Node*> stack;
  for (const auto& out : outputs) {
    if (!out.defined() || !out.requires_grad()) continue;
    auto edge = torch::autograd::impl::gradient_edge(out);
    if (edge.function && reached.insert(edge.function.get()).second) stack.push_back(edge.function.get());
  }
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const auto& e : n->next_edges()) {
      if (e.function && reached.insert(e.function.get()).second) stack.push_back(e.function.get());
    }
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!reached.count(hooks_[i].first.get())) markReady(i, /*used=*/false);
  }
}

void Reducer::queueFinalize() {
  std::lock_guard<std::mutex> lock(mu_);
  if (expectBackward_) queueFinalizeLocked();
}

void Reducer::queueFinalizeLocked() {
  if (callbackQueued_) return;
  callbackQueued_ = true;
  torch::autograd::Engine::get_default_engine().queue_callback([this] { finalizeBackward(); });
}

void Reducer::registerCommHook(std::shared_ptr<CommHook> hook) {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK_VALUE(hook != nullptr, "register_comm_hook: the hook is None");
  TORCH_CHECK(!hook_, "register_comm_hook: a comm hook (", hook_->name(), ") is already registered; it can be "
              "registered only once per DistributedDataParallel");
  TORCH_CHECK(iterations_ == 0 && !expectBackward_, "register_comm_hook: register the hook (", hook->name(),
              ") before the first forward/backward; ", iterations_, " iteration(s) already ran");
  hook_ = std::move(hook);
  for (auto& b : buckets_) {  // the hook gets flat buckets
    b.direct = false;
    ensureFlat(b);
  }
}

void Reducer::autogradHook(size_t index) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!expectBackward_) return;  // no_sync(), or a backward without a DDP forward: accumulate locally
  queueFinalizeLocked();
  if (opts_.staticGraph) {
    if (iterations_ == 0) {  // record; every bucket is reduced at the end of this backward
      if (hookCounts_[index]++ == 0) readyOrder_.push_back(index);
      return;
    }
    TORCH_CHECK(remaining_[index] > 0, "DistributedDataParallel(static_graph=True): parameter ", names_[index],
                " received more gradients in this backward than in the first iteration (", hookCounts_[index],
                "); static_graph=True needs every iteration to use the parameters the same way");
    if (--remaining_[index] == 0) markReady(index, /*used=*/true);
    return;
  }
  TORCH_CHECK(!ready_[index], "DistributedDataParallel: parameter ", names_[index],
              " received its gradient twice in one backward (its gradient accumulator ran twice, e.g. under "
              "reentrant activation checkpointing). Construct DistributedDataParallel(..., static_graph=True) "
              "when the model uses its parameters the same way in every iteration");
  if (iterations_ == 0) readyOrder_.push_back(index);
  markReady(index, /*used=*/true);
}

void Reducer::markReady(size_t index, bool used) {
  ready_[index] = true;
  locallyUsed_[index] = used;
  auto [bi, pos] = where_[index];
  Bucket& b = buckets_[bi];
  if (used) {
    fillSlot(index, b, pos);
  } else {
    ensureFlat(b);
    at::Tensor& view = b.views[pos];
    view.zero_();
    if (b.direct) {
      b.slots[pos] = view;
      b.inGrad[pos] = false;
    }
  }
  if (--b.pending == 0) launchReadyBuckets();
}

void Reducer::fillSlot(size_t index, Bucket& b, size_t pos) {
  const int64_t ws = divFactor_;
  at::Tensor grad = params_[index].grad();
  TORCH_CHECK(grad.defined(), "DistributedDataParallel: parameter ", names_[index], " has no gradient in its hook");
  if (b.direct) {
    // Reduced where it lies when it can be (PREMUL_SUM scales it); otherwise copied unscaled.
    b.inGrad[pos] = grad.layout() == at::kStrided && grad.is_contiguous() &&
                    grad.scalar_type() == c10::typeMetaToScalarType(b.options.dtype()) &&
                    grad.device() == b.options.device();
    if (b.inGrad[pos]) {
      b.slots[pos] = grad;
    } else {
      ensureFlat(b);
      b.views[pos].copy_(grad);
      b.slots[pos] = b.views[pos];
    }
    return;
  }
  at::Tensor& view = b.views[pos];
  if (hook_) {
    // A comm hook gets the local gradients unscaled (it divides by the world size itself).
    if (!(opts_.gradientAsBucketView && grad.is_alias_of(view))) {
      view.copy_(grad);
      if (opts_.gradientAsBucketView) params_[index].mutable_grad() = view;
    }
  } else {
    // The same arithmetic as torch's DDP, so both give the same bits: a gradient copied into the
    // bucket is multiplied by 1/world_size; one already living in the bucket is divided in place.
    if (opts_.gradientAsBucketView && grad.is_alias_of(view)) {
      view.div_(ws);
    } else {
      // One pass: scale while copying (a wrapped scalar computes in the gradient's dtype).
      at::Tensor scale = c10::scalar_to_tensor(at::Scalar(1.0 / static_cast<double>(ws)));
      scale.unsafeGetTensorImpl()->set_wrapped_number(true);
      at::mul_out(view, grad, scale);
      if (opts_.gradientAsBucketView) params_[index].mutable_grad() = view;
    }
  }
}

void Reducer::launchReadyBuckets() {
  // In index order, so every rank issues the same sequence of collectives.
  while (nextBucket_ < buckets_.size() && buckets_[nextBucket_].pending == 0) {
    Bucket& b = buckets_[nextBucket_];
    if (b.direct) {
      launchDirect(nextBucket_, b.slots);
    } else {
      launchBucket(nextBucket_, b.flat);
    }
    ++nextBucket_;
  }
}

void Reducer::launchBucket(size_t bi, const at::Tensor& flat) {
  Bucket& b = buckets_[bi];
  if (!hook_) {
    std::vector<at::Tensor> ts{flat};
    b.work = pg_->allreduce(ts);
    return;
  }
  std::vector<at::Tensor> params;
  for (size_t i : b.params) params.push_back(params_[i]);
  c10d::GradBucket gb(bi, buckets_.size(), flat, b.offsets, b.lengths, b.sizes, std::move(params), std::nullopt);
  b.inflight = hook_->run(gb);
}

void Reducer::launchDirect(size_t bi, std::vector<at::Tensor> tensors) {
  c10d::AllreduceCoalescedOptions o;
  // Built by hand: c10d::makePreMulSum is makeNCCLPreMulSum up to torch 2.11 (the supplement type
  // keeps its old name as an alias).
  o.reduceOp.op_ = c10d::ReduceOp::PREMUL_SUM;
  o.reduceOp.supplement_ = c10::make_intrusive<c10d::NCCLPreMulSumSupplement>(1.0 / static_cast<double>(divFactor_));
  buckets_[bi].work = premulBackend_->allreduce_coalesced(tensors, o);
}

void Reducer::waitBucket(size_t bi) {
  Bucket& b = buckets_[bi];
  if (!b.inflight) {
    if (b.work) b.work->wait();
    return;
  }
  at::Tensor result = b.inflight->wait();
  b.inflight.reset();
  TORCH_CHECK(result.defined() && result.numel() == b.flat.numel(), "DDP comm hook ", hook_->name(),
              " returned a tensor of ", (result.defined() ? result.numel() : 0), " elements for bucket ", bi,
              ", which holds ", b.flat.numel(), "; a hook's future must hold the reduced bucket");
  if (!(result.data_ptr() == b.flat.data_ptr() && result.scalar_type() == b.flat.scalar_type())) {
    b.flat.copy_(result.reshape({-1}));
  }
}

void Reducer::failUnfinished() {
  std::ostringstream names;
  size_t count = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!ready_[i]) names << (count++ ? ", " : "") << names_[i];
  }
  // Let the buckets that did start finish, so the group stays usable.
  for (size_t bi = 0; bi < nextBucket_; ++bi) waitBucket(bi);
  expectBackward_ = false;
  TORCH_CHECK(false, "DistributedDataParallel: ", count, " parameter(s) received no gradient in this backward: ",
              names.str(),
              ". Their buckets could not be reduced. If some parameters are unused in some iterations, construct "
              "DistributedDataParallel(..., find_unused_parameters=True); if forward's outputs do not all take "
              "part in the loss, make them take part or use find_unused_parameters=True");
}

void Reducer::finalizeBackward() {
  std::lock_guard<std::mutex> lock(mu_);
  if (!expectBackward_) return;
  const bool staticFirst = opts_.staticGraph && iterations_ == 0;
  if (staticFirst) {
    // Every accumulator has run as often as it will: reduce all buckets now, in order.
    for (size_t i = 0; i < params_.size(); ++i) markReady(i, /*used=*/hookCounts_[i] > 0);
  }
  if (nextBucket_ < buckets_.size()) failUnfinished();
  expectBackward_ = false;
  std::vector<bool> globallyUsed(params_.size(), true);
  if (opts_.staticGraph && !staticFirst) globallyUsed = staticUsed_;
  if (opts_.findUnusedParameters || staticFirst) {
    at::Tensor used = at::zeros({static_cast<int64_t>(params_.size())}, at::kInt);
    for (size_t i = 0; i < params_.size(); ++i) used[i] = locallyUsed_[i] ? 1 : 0;
    std::vector<at::Tensor> ts{used};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::MAX;
    pg_->allreduce(ts, o)->wait();
    auto acc = used.accessor<int32_t, 1>();
    for (size_t i = 0; i < params_.size(); ++i) globallyUsed[i] = acc[i] != 0;
    if (staticFirst) staticUsed_ = globallyUsed;
  }
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    Bucket& b = buckets_[bi];
    waitBucket(bi);
    for (size_t k = 0; k < b.params.size(); ++k) {
      at::Tensor& p = params_[b.params[k]];
      if (!globallyUsed[b.params[k]]) continue;  // no rank produced a gradient: leave .grad alone
      if (b.direct && b.inGrad[k]) continue;      // reduced in place
      if (opts_.gradientAsBucketView) {
        if (!p.grad().defined() || !p.grad().is_alias_of(b.views[k])) p.mutable_grad() = b.views[k];
      } else if (p.grad().defined()) {
        p.mutable_grad().copy_(b.views[k]);
      } else {
        p.mutable_grad() = b.views[k].clone();
      }
    }
    if (b.direct) {  // drop the references to the gradients (zero_grad(set_to_none) frees them)
      for (auto& t : b.slots) t.reset();
      b.work.reset();
    }
  }
  ++iterations_;
}

void Reducer::joinShadowBackward() {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(!expectBackward_, "join: a backward of this rank is still pending");
  if (rebuildDue()) rebuildFromObservedOrder();
  // The same collectives, in the same order, as a rank that ran forward and backward: one per
  // bucket (zeros: a joined rank contributes nothing), then the used-parameter map if any.
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    at::Tensor zeros = at::zeros({buckets_[bi].numel}, buckets_[bi].options);
    if (buckets_[bi].direct) {
      launchDirect(bi, {zeros});
    } else {
      launchBucket(bi, zeros);
    }
  }
  for (size_t bi = 0; bi < buckets_.size(); ++bi) {
    Bucket& b = buckets_[bi];
    if (b.inflight) {
      b.inflight->wait();
      b.inflight.reset();
    } else if (b.work) {
      b.work->wait();
    }
    b.work.reset();
  }
  const bool staticFirst = opts_.staticGraph && iterations_ == 0;
  if (opts_.findUnusedParameters || staticFirst) {
    at::Tensor used = at::zeros({static_cast<int64_t>(params_.size())}, at::kInt);
    std::vector<at::Tensor> ts{used};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::MAX;
    pg_->allreduce(ts, o)->wait();
    if (staticFirst) {
      auto acc = used.accessor<int32_t, 1>();
      for (size_t i = 0; i < params_.size(); ++i) staticUsed_[i] = acc[i] != 0;
    }
  }
  ++iterations_;
}

void Reducer::rebuildFromObservedOrder() {
  // Rank 0's observed order wins, so every rank builds the same buckets.
  std::vector<bool> seen(params_.size(), false);
  at::Tensor order = at::empty({static_cast<int64_t>(params_.size())}, at::kLong);
  int64_t k = 0;
  for (size_t i : readyOrder_) {
    if (!seen[i]) {
      seen[i] = true;
      order[k++] = static_cast<int64_t>(i);
    }
  }
  for (size_t i = params_.size(); i-- > 0;) {
    if (!seen[i]) order[k++] = static_cast<int64_t>(i);
  }
  std::vector<at::Tensor> ts{order};
  c10d::BroadcastOptions o;
  o.rootRank = 0;
  pg_->broadcast(ts, o)->wait();
  std::vector<size_t> newOrder;
  auto acc = order.accessor<int64_t, 1>();
  for (int64_t i = 0; i < order.numel(); ++i) newOrder.push_back(static_cast<size_t>(acc[i]));
  buildBuckets(newOrder);
  rebuilt_ = true;
  if (hook_) hook_->bucketsRebuilt();
}

}  // namespace tdx
