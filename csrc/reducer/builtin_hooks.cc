#include "reducer/builtin_hooks.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <functional>

#include "backend/cuda_registry.h"
#include "common/round_up.h"
#include "kernels/compress_cpu.h"

namespace tdx {
namespace {

namespace k = tdx::kernels;

// Waits on the collective, then runs `finish` (decompression), which returns the result.
class WorkThen : public PendingBucket {
 public:
  WorkThen(c10::intrusive_ptr<c10d::Work> work, std::function<at::Tensor()> finish)
      : work_(std::move(work)), finish_(std::move(finish)) {}
  at::Tensor wait() override {
    work_->wait();
    return finish_();
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  std::function<at::Tensor()> finish_;
};

enum class Kind { kAllreduce, kFp16, kBf16, kInt8, kTopk };

Kind parseKind(const std::string& s) {
  if (s == "allreduce") return Kind::kAllreduce;
  if (s == "fp16") return Kind::kFp16;
  if (s == "bf16") return Kind::kBf16;
  if (s == "int8") return Kind::kInt8;
  if (s == "topk") return Kind::kTopk;
  TORCH_CHECK_VALUE(false, "unknown built-in comm hook '", s, "'; expected one of allreduce, fp16, bf16, int8, topk");
}

class BuiltinHook : public CommHook {
 public:
  BuiltinHook(c10::intrusive_ptr<c10d::ProcessGroup> pg, BuiltinHookOptions opts)
      : pg_(std::move(pg)), opts_(std::move(opts)), kind_(parseKind(opts_.kind)) {
    TORCH_CHECK_VALUE(opts_.int8Block >= 1, "int8 comm hook: block must be >= 1, got ", opts_.int8Block);
    TORCH_CHECK_VALUE(opts_.topkRatio > 0.0 && opts_.topkRatio <= 1.0,
                      "topk comm hook: ratio must be in (0, 1], got ", opts_.topkRatio);
  }

  std::string name() const override { return opts_.kind; }
  void bucketsRebuilt() override { residuals_.clear(); }  // the residual of iteration 0 is dropped

  std::unique_ptr<PendingBucket> run(c10d::GradBucket& bucket) override {
    at::Tensor buf = bucket.getBufferRef();
    const int64_t ws = pg_->getSize();
    if (kind_ == Kind::kAllreduce || !compressible(buf)) return allreduce(buf, ws);
    switch (kind_) {
      case Kind::kFp16:
      case Kind::kBf16: return halfPrecision(buf, ws);
      case Kind::kInt8: return int8(buf, bucket.getIndex(), ws);
      case Kind::kTopk: return topk(buf, bucket.getIndex(), ws);
      default: break;
    }
    TORCH_CHECK(false, "unreachable");
  }

 private:
  // float32 contiguous buckets on CPU, and on CUDA where this build has the CUDA kernels.
  static bool compressible(const at::Tensor& buf) {
    if (buf.scalar_type() != at::kFloat || !buf.is_contiguous()) return false;
    if (buf.is_cuda()) return cudaRegistration() != nullptr;
    return buf.device().is_cpu();
  }

  std::unique_ptr<PendingBucket> allreduce(at::Tensor buf, int64_t ws) {
    buf.div_(ws);
    std::vector<at::Tensor> ts{buf};
    return std::make_unique<WorkThen>(pg_->allreduce(ts), [buf] { return buf; });
  }

  std::unique_ptr<PendingBucket> halfPrecision(at::Tensor buf, int64_t ws) {
    const int64_t n = buf.numel();
    const bool half = kind_ == Kind::kFp16;
    buf.mul_(1.0 / static_cast<double>(ws));
    at::Tensor c = at::empty({n}, buf.options().dtype(half ? at::kHalf : at::kBFloat16));
    if (buf.is_cuda()) {  // the same element math on the current stream, which the collective follows
      const CudaRegistration& cuda = *cudaRegistration();
      cuda.compressHalf(buf, c);
      std::vector<at::Tensor> ts{c};
      auto work = pg_->allreduce(ts);
      return std::make_unique<WorkThen>(std::move(work), [buf, c, &cuda] {  // after wait(): on the waiting stream
        cuda.decompressHalf(c, buf);
        return buf;
      });
    }
    auto* cp = static_cast<uint16_t*>(c.data_ptr());
    if (half) {
      k::fp16Compress(buf.data_ptr<float>(), cp, n);
    } else {
      k::bf16Compress(buf.data_ptr<float>(), cp, n);
    }
    std::vector<at::Tensor> ts{c};
    auto work = pg_->allreduce(ts);
    return std::make_unique<WorkThen>(std::move(work), [buf, c, n, half] {
      const auto* cp = static_cast<const uint16_t*>(c.data_ptr());
      if (half) {
        k::fp16Decompress(cp, buf.data_ptr<float>(), n);
      } else {
        k::bf16Decompress(cp, buf.data_ptr<float>(), n);
      }
      return buf;
    });
  }

  // The error-feedback residual of bucket `index` (zeros when new or when the buckets changed).
  at::Tensor& residual(size_t index, const at::Tensor& buf) {
    at::Tensor& r = residuals_[index];
    if (!r.defined() || r.numel() != buf.numel()) r = at::zeros_like(buf);
    return r;
  }

  std::unique_ptr<PendingBucket> gatherThen(at::Tensor send, int64_t ws,
                                            std::function<at::Tensor(const std::vector<at::Tensor>&)> finish) {
    std::vector<std::vector<at::Tensor>> outs(1);
    for (int64_t r = 0; r < ws; ++r) outs[0].push_back(at::empty_like(send));
    std::vector<at::Tensor> ins{send};
    auto work = pg_->allgather(outs, ins);
    auto gathered = outs[0];
    return std::make_unique<WorkThen>(std::move(work), [gathered, finish] { return finish(gathered); });
  }

  std::unique_ptr<PendingBucket> int8(at::Tensor buf, size_t index, int64_t ws) {
    const int64_t n = buf.numel();
    const int block = static_cast<int>(opts_.int8Block);
    const int64_t nb = k::int8NumBlocks(n, block);
    const int64_t qBytes = roundUp(n, 4);  // scales stay 4-byte aligned
    at::Tensor& r = residual(index, buf);
    at::Tensor send = at::empty({qBytes + 4 * nb}, buf.options().dtype(at::kByte));
    auto* q = reinterpret_cast<int8_t*>(send.data_ptr<uint8_t>());
    auto* scales = reinterpret_cast<float*>(send.data_ptr<uint8_t>() + qBytes);
    const double inv = 1.0 / static_cast<double>(ws);
    if (buf.is_cuda()) {  // one kernel: c = g + r, quantize c, r = c - dequantize(q)
      const CudaRegistration& cuda = *cudaRegistration();
      cuda.int8Quantize(buf, r, block, send.narrow(0, 0, n), send.narrow(0, qBytes, 4 * nb));
      return gatherThen(send, ws, [buf, n, nb, qBytes, block, inv, &cuda](const std::vector<at::Tensor>& all) {
        buf.zero_();
        for (const auto& t : all) {  // rank order, as on CPU
          cuda.int8Dequantize(t.narrow(0, 0, n), t.narrow(0, qBytes, 4 * nb), block, buf, /*accumulate=*/true);
        }
        buf.mul_(inv);
        return buf;
      });
    }
    buf.add_(r);  // c = g + r
    k::int8BlockQuantize(buf.data_ptr<float>(), n, block, q, scales);
    k::int8BlockDequantize(q, scales, n, block, r.data_ptr<float>());
    at::sub_out(r, buf, r);  // r = c - decompress(compress(c))
    return gatherThen(send, ws, [buf, n, nb, qBytes, block, inv](const std::vector<at::Tensor>& all) {
      buf.zero_();
      for (const auto& t : all) {  // rank order: every rank sums the same way, to the same bits
        const uint8_t* p = t.data_ptr<uint8_t>();
        k::int8BlockDequantizeAdd(reinterpret_cast<const int8_t*>(p), reinterpret_cast<const float*>(p + qBytes), n,
                                  block, buf.data_ptr<float>());
      }
      (void)nb;
      buf.mul_(inv);
      return buf;
    });
  }

  std::unique_ptr<PendingBucket> topk(at::Tensor buf, size_t index, int64_t ws) {
    const int64_t n = buf.numel();
    const int64_t kk = std::min<int64_t>(n, std::max<int64_t>(1, static_cast<int64_t>(std::ceil(opts_.topkRatio * n))));
    at::Tensor& r = residual(index, buf);
    buf.add_(r);  // c = g + r
    at::Tensor send = at::empty({12 * kk}, buf.options().dtype(at::kByte));
    const double inv = 1.0 / static_cast<double>(ws);
    if (!buf.device().is_cpu()) return topkWithTensorOps(buf, r, send, kk, ws, inv);
    auto* idx = reinterpret_cast<int64_t*>(send.data_ptr<uint8_t>());
    auto* vals = reinterpret_cast<float*>(send.data_ptr<uint8_t>() + 8 * kk);
    k::topkSelect(buf.data_ptr<float>(), n, kk, idx, vals);
    r.copy_(buf);  // r = c - sparse(c): c with the sent entries zeroed
    float* rp = r.data_ptr<float>();
    for (int64_t j = 0; j < kk; ++j) rp[idx[j]] = 0.0f;
    return gatherThen(send, ws, [buf, kk, inv](const std::vector<at::Tensor>& all) {
      buf.zero_();
      for (const auto& t : all) {
        const uint8_t* p = t.data_ptr<uint8_t>();
        k::scatterAdd(reinterpret_cast<const int64_t*>(p), reinterpret_cast<const float*>(p + 8 * kk), kk,
                      buf.data_ptr<float>());
      }
      buf.mul_(inv);
      return buf;
    });
  }

  // topk on a device bucket with ATen ops, selecting what topkSelect selects: a stable descending
  // sort of |c| puts the larger magnitudes first, ties in index order, NaN first (the largest);
  // the k chosen go in increasing index order. Indices are unique, so index_add_ adds each
  // rank's values once per element and the rank-order sum has the CPU's bits.
  std::unique_ptr<PendingBucket> topkWithTensorOps(at::Tensor buf, at::Tensor& r, at::Tensor send, int64_t kk,
                                                   int64_t ws, double inv) {
    auto order = std::get<1>(at::sort(buf.abs(), /*stable=*/true, /*dim=*/0, /*descending=*/true));
    at::Tensor idx = std::get<0>(at::sort(order.narrow(0, 0, kk)));
    send.narrow(0, 0, 8 * kk).view(at::kLong).copy_(idx);
    send.narrow(0, 8 * kk, 4 * kk).view(at::kFloat).copy_(buf.index_select(0, idx));
    r.copy_(buf);
    r.index_fill_(0, idx, 0.0);  // r = c - sparse(c)
    return gatherThen(send, ws, [buf, kk, inv](const std::vector<at::Tensor>& all) {
      buf.zero_();
      for (const auto& t : all) {
        buf.index_add_(0, t.narrow(0, 0, 8 * kk).view(at::kLong), t.narrow(0, 8 * kk, 4 * kk).view(at::kFloat));
      }
      buf.mul_(inv);
      return buf;
    });
  }

  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  BuiltinHookOptions opts_;
  Kind kind_;
  std::map<size_t, at::Tensor> residuals_;
};

}  // namespace

std::shared_ptr<CommHook> makeBuiltinHook(c10::intrusive_ptr<c10d::ProcessGroup> pg, BuiltinHookOptions opts) {
  return std::make_shared<BuiltinHook>(std::move(pg), std::move(opts));
}

}  // namespace tdx
