// Point-to-point across hosts: every send and receive of a group spanning hosts goes through its
// all-ranks Gloo group (one matching engine, so receiving from any source works).
#include <c10/util/Exception.h>

#include "backend/tensor_utils.h"
#include "multihost/flat.h"
#include "multihost/gloo_wait.h"

namespace tdx {

namespace {

void checkUserTag(int tag) {
  TORCH_CHECK_VALUE(tag != kBroadcastTag && tag != kBarrierTag, "tdx: p2p tag ", tag,
                    " is reserved by tdx on groups spanning hosts (its broadcast and barrier use ", kBarrierTag,
                    " and ", kBroadcastTag, "); use another tag");
}

// p2p through Gloo; a receive into a non-contiguous tensor is written back on wait(). The wait ends
// early (AbortedError) when this host's group is aborted or interrupted (elastic recovery: the peer
// may wait for a lost host itself and never send).
class GlooP2PWork : public c10d::Work {
 public:
  GlooP2PWork(GlooWork inner, std::shared_ptr<Staged> staged, bool writeBack, int rank, c10d::OpType type,
              at::Tensor user, const Link& link)
      : c10d::Work(rank, type), inner_(std::move(inner)), staged_(std::move(staged)), writeBack_(writeBack),
        user_(std::move(user)), local_(&link.local()), groups_(link.glooGroups()),
        op_(type == c10d::OpType::SEND ? "send" : "recv") {}
  bool isCompleted() override { return inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  int sourceRank() const override { return inner_->sourceRank(); }
  std::vector<at::Tensor> result() override { return {user_}; }
  void abort() override { inner_->abort(); }
  bool wait(std::chrono::milliseconds timeout) override {
    const WaitContext ctx = waitFromNow(op_, 0, timeout);
    waitGlooP2PWatchingHost({inner_}, ctx, local_, groups_, nullptr, /*hostMates=*/false);
    const bool ok = true;  // a failed or ended wait threw
    if (writeBack_ && !written_) {
      staged_->finish();
      written_ = true;
    }
    return ok;
  }

 private:
  GlooWork inner_;
  std::shared_ptr<Staged> staged_;
  bool writeBack_;
  bool written_ = false;
  at::Tensor user_;
  const shm::ShmGroup* local_;
  std::vector<c10::intrusive_ptr<c10d::Backend>> groups_;
  const char* op_;
};

}  // namespace

GlooWork glooSend(Link& link, const at::Tensor& tensor, int dst, int tag) {
  checkUserTag(tag);
  auto staged = std::make_shared<Staged>(tensor);
  std::vector<at::Tensor> v{bytesOf(staged->tensor())};
  return c10::make_intrusive<GlooP2PWork>(link.all().send(v, dst, tag), staged, false, link.rank(),
                                          c10d::OpType::SEND, tensor, link);
}

GlooWork glooRecv(Link& link, const at::Tensor& tensor, int src, int tag) {
  checkUserTag(tag);
  auto staged = std::make_shared<Staged>(tensor, /*copyIn=*/false);
  std::vector<at::Tensor> v{bytesOf(staged->tensor())};
  auto inner = src < 0 ? link.all().recvAnysource(v, tag) : link.all().recv(v, src, tag);
  return c10::make_intrusive<GlooP2PWork>(std::move(inner), staged, !staged->tensor().is_same(tensor), link.rank(),
                                          src < 0 ? c10d::OpType::RECVANYSOURCE : c10d::OpType::RECV, tensor, link);
}

}  // namespace tdx
