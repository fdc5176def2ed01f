// TdxBackend: construction, shutdown, the progress plumbing, point-to-point and barrier.
// The collective overrides live in tdx_collectives.cc.
#include "backend/tdx_backend.h"

#include <sched.h>
#include <unistd.h>

#include <c10/util/Exception.h>

#include <condition_variable>
#include <cstdlib>
#include <mutex>

#include "backend/cuda_staging.h"
#include "backend/tensor_utils.h"
#include "collectives/collectives.h"
#include "common/env.h"
#include "common/logging.h"

#ifdef TDX_WITH_CUDA
#include "backend/nccl_path.h"
#endif

namespace tdx {

namespace {

class StoreRendezvous : public Rendezvous {
 public:
  explicit StoreRendezvous(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::string& value) override {
    store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  std::string get(const std::string& key) override {
    auto v = store_->get(key);
    return std::string(v.begin(), v.end());
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

// Keys under a per-host prefix, so each host's shared-memory group has its own namespace.
class PrefixRendezvous : public Rendezvous {
 public:
  PrefixRendezvous(Rendezvous& inner, std::string prefix) : inner_(inner), prefix_(std::move(prefix)) {}
  void set(const std::string& key, const std::string& value) override { inner_.set(prefix_ + key, value); }
  std::string get(const std::string& key) override { return inner_.get(prefix_ + key); }

 private:
  Rendezvous& inner_;
  std::string prefix_;
};

std::string nodeId() {
  if (const char* id = std::getenv("TDX_NODE_ID"); id && *id) return id;
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return host;
}

// The cores this host's ranks can spread over. A process pinned to a single CPU was placed by a
// launcher that pins one rank per core (mpirun --bind-to core, numactl, the benchmark): its own
// mask says nothing about the group's, so the machine's count is used then. Ranks that do end up on
// one core are caught per wait (shm::ShmGroup: no spinning on a peer that last ran on this CPU).
int availableCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 1) return CPU_COUNT(&set);
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

}  // namespace

TdxBackend::TdxBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout, std::string groupName, std::vector<int64_t> globalRanks,
                       std::vector<std::string> nodeIds, c10::intrusive_ptr<c10d::Backend> glooAll,
                       c10::intrusive_ptr<c10d::Backend> glooSlice)
    : c10d::Backend(rank, size), timeout_(timeout), store_(store) {
  info_.rank = rank;
  info_.size = size;
  info_.name = groupName.empty() ? "default" : groupName;
  info_.globalRanks = std::move(globalRanks);
  StoreRendezvous rdv(store);

  // Node ids come from the Python creator (which also made the Gloo groups for multi-host mode);
  // direct callers leave them empty and they are exchanged here.
  if (nodeIds.empty()) {
    rdv.set(str("tdx/node/", rank), nodeId());
    for (int r = 0; r < size; ++r) nodeIds.push_back(r == rank ? nodeId() : rdv.get(str("tdx/node/", r)));
  }
  TORCH_CHECK_VALUE(static_cast<int>(nodeIds.size()) == size, "tdx: got ", nodeIds.size(), " node ids for a group of ",
                    size, " ranks");
  nodeIds_ = nodeIds;
  const HostLayout layout = computeHostLayout(nodeIds, rank);
  GroupInfo localInfo = info_;
  std::unique_ptr<PrefixRendezvous> hostRdv;
  if (layout.numHosts > 1) {
    TORCH_CHECK(glooAll, "tdx: rank ", info_.describeRank(rank), " runs on host '", nodeIds[rank],
                "' but the group spans ", layout.numHosts, " hosts, and no Gloo group was given for the cross-host "
                "part; create tdx process groups through torch.distributed after `import torchdist_ext`");
    hier_ = std::make_unique<Hierarchy>(layout, rank, size, glooAll, glooSlice, store, nodeIds, info_.globalRanks);
    localInfo.rank = layout.localRank;
    localInfo.size = layout.localSize;
    localInfo.name = str(info_.name, "/host", layout.hostIndex);
    localInfo.globalRanks.clear();
    for (int r : layout.localRanks) {
      localInfo.globalRanks.push_back(info_.globalRanks.empty() ? r : info_.globalRanks[r]);
    }
    hostRdv = std::make_unique<PrefixRendezvous>(rdv, str("tdx/host", layout.hostIndex, "/"));
  }

  const EnvKnobs& knobs = env();
  shm::ShmOptions opts;
  opts.halfBytes = (knobs.bufferBytes + 63) / 64 * 64;
  opts.ringBytes = (knobs.p2pRingBytes + 63) / 64 * 64;
  // When this host's ranks outnumber its cores, waits give the core up sooner.
  // Across hosts, a host mate is waited for while it waits on the network: polling would only take
  // the core from the threads moving the data.
  const bool oversubscribed = localInfo.size > availableCores() || layout.numHosts > 1;
  opts.wait.spinTime = std::chrono::microseconds(knobs.spinUs >= 0 ? knobs.spinUs : (oversubscribed ? 5 : 50));
  opts.wait.yieldTime =
      std::chrono::microseconds(knobs.yieldUs >= 0 ? knobs.yieldUs : (oversubscribed ? 100 : 2000));
  try {
    group_ = std::make_unique<shm::ShmGroup>(localInfo, hostRdv ? static_cast<Rendezvous&>(*hostRdv) : rdv, opts);
  } catch (const Error& e) {
    TORCH_CHECK(false, e.what());
  }
  if (hier_) hier_->attachLocal(group_.get());
  // In multi-host mode all p2p goes through Gloo (one matching engine, so any-source receives work).
  if (!hier_) {
    p2p_ = std::make_unique<P2PEngine>(
        *group_, [](int dtype) { return std::string(c10::toString(static_cast<c10::ScalarType>(dtype))); });
  }
  queue_ = std::make_unique<CollectiveQueue>();
}

TdxBackend::~TdxBackend() { shutdown(); }

c10::intrusive_ptr<c10d::Backend::Options> TdxBackend::getBackendOptions() {
  return c10::make_intrusive<c10d::Backend::Options>("tdx", timeout_);
}

void TdxBackend::shutdown() {
  if (shutdown_.exchange(true)) return;
  // Interrupt waits (destroy_process_group may run while another thread is blocked in a
  // collective): queued collectives then fail fast, and the threads stop.
  if (group_) group_->abort();
  if (queue_) queue_->stop();
  if (p2p_) p2p_->shutdown();
#ifdef TDX_WITH_CUDA
  if (nccl_) nccl_->shutdown();
#endif
}

void TdxBackend::abort() {
#ifdef TDX_WITH_CUDA
  if (nccl_) nccl_->abort();
#endif
  if (group_) group_->abort();
  shutdown();
}

void TdxBackend::checkAlive(const char* op) const {
  TORCH_CHECK(!shutdown_.load(), "tdx: ", op, " called on group '", info_.name,
              "' after it was shut down or destroyed; create a new process group first");
}

void TdxBackend::checkRoot(const char* op, int64_t root) const {
  TORCH_CHECK_VALUE(root >= 0 && root < size_, "tdx: ", op, ": root rank ", root,
                    " is out of range for a group of size ", size_, "; use a rank in [0, ", size_ - 1, "]");
}

void TdxBackend::checkPeer(const char* op, int peer) const {
  TORCH_CHECK_VALUE(peer >= 0 && peer < size_, "tdx: ", op, ": peer rank ", peer,
                    " is out of range for a group of size ", size_, "; use a rank in [0, ", size_ - 1, "]");
  TORCH_CHECK_VALUE(peer != rank_, "tdx: ", op, ": peer rank ", peer, " is this rank; a rank cannot ", op,
                    " to or from itself");
}

WaitContext TdxBackend::contextFor(const char* name, uint64_t seq) const {
  WaitContext ctx;
  ctx.op = name;
  ctx.seq = seq;
  ctx.timeout = timeout_;
  ctx.deadline = std::chrono::steady_clock::now() + timeout_;
  return ctx;
}

c10::intrusive_ptr<c10d::Work> TdxBackend::enqueue(c10d::OpType type, const char* name,
                                                   std::vector<at::Tensor> outputs, bool asyncOp,
                                                   std::function<void(const WaitContext&)> body) {
  checkAlive(name);
  const uint64_t seq = ++collSeq_;
  auto work = c10::make_intrusive<TdxWork>(rank_, type, seq, name, std::move(outputs), std::nullopt);
  queue_->submit(
      [this, work, name, seq, body = std::move(body)]() mutable {
        std::exception_ptr err;
        try {
          body(contextFor(name, seq));
        } catch (...) {
          err = std::current_exception();
        }
        // Drop the tensors the body holds (and this task's reference to the Work) before the
        // waiter wakes: a caller that frees its buffers after wait() must see the memory freed
        // then, not whenever this worker thread next gets a core (FSDP's peak memory).
        body = nullptr;
        c10::intrusive_ptr<TdxWork> done = std::move(work);
        done->complete(err);
      },
      !asyncOp);
  return track(work);
}

bool TdxBackend::runDirect(const char* name,
                           const std::function<void(shm::ShmGroup&, const WaitContext&)>& body) {
  if (hier_) return false;
  checkAlive(name);
  const uint64_t seq = ++collSeq_;
  // Inline when the queue is idle (the usual case); otherwise after the queued collectives.
  struct {
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    std::exception_ptr err;
  } st;
  queue_->submit(
      [&] {
        try {
          body(*group_, contextFor(name, seq));
        } catch (...) {
          st.err = std::current_exception();
        }
        std::lock_guard<std::mutex> lock(st.mu);
        st.done = true;
        st.cv.notify_one();
      },
      true);
  std::unique_lock<std::mutex> lock(st.mu);
  st.cv.wait(lock, [&] { return st.done; });
  if (st.err) std::rethrow_exception(toTorchError(st.err));
  return true;
}

c10::intrusive_ptr<c10d::Work> TdxBackend::enqueueP2P(c10d::OpType type, const char* name, at::Tensor tensor,
                                                      int peer, int tag) {
  checkAlive(name);
  checkTensor(name, tensor);
  const bool isSend = type == c10d::OpType::SEND;
  const uint64_t seq = ++p2pSeq_;
  auto staged = std::make_shared<Staged>(tensor, /*copyIn=*/isSend);
  auto work = c10::make_intrusive<TdxWork>(rank_, type, seq, name, std::vector<at::Tensor>{tensor}, std::nullopt);
  auto done = [work, staged](std::exception_ptr err, int src) {
    if (!err) {
      try {
        staged->finish();
      } catch (...) {
        err = std::current_exception();
      }
    }
    work->complete(err, src);
  };
  WaitContext ctx = contextFor(name, seq);
  const int dtype = static_cast<int>(tensor.scalar_type());
  if (isSend) {
    p2p_->send(staged->data(), staged->bytes(), peer, tag, ctx, std::move(done), dtype);
  } else {
    p2p_->recv(staged->data(), staged->bytes(), peer, tag, ctx, std::move(done), dtype);
  }
  return track(work);
}

c10::intrusive_ptr<c10d::Work> TdxBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  TORCH_CHECK_VALUE(tensors.size() == 1, "tdx: send takes exactly one tensor, got ", tensors.size());
  checkPeer("send", dstRank);
  if (auto dev = cudaDeviceOf("send", tensors)) return cudaP2P(*dev, c10d::OpType::SEND, tensors[0], dstRank, tag);
  if (hier_) {
    checkAlive("send");
    checkTensor("send", tensors[0]);
    return hier_->send(tensors[0], dstRank, tag);
  }
  return enqueueP2P(c10d::OpType::SEND, "send", tensors[0], dstRank, tag);
}

c10::intrusive_ptr<c10d::Work> TdxBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  TORCH_CHECK_VALUE(tensors.size() == 1, "tdx: recv takes exactly one tensor, got ", tensors.size());
  checkPeer("recv", srcRank);
  if (auto dev = cudaDeviceOf("recv", tensors)) return cudaP2P(*dev, c10d::OpType::RECV, tensors[0], srcRank, tag);
  if (hier_) {
    checkAlive("recv");
    checkTensor("recv", tensors[0]);
    return hier_->recv(tensors[0], srcRank, tag);
  }
  return enqueueP2P(c10d::OpType::RECV, "recv", tensors[0], srcRank, tag);
}

c10::intrusive_ptr<c10d::Work> TdxBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  TORCH_CHECK_VALUE(tensors.size() == 1, "tdx: recv takes exactly one tensor, got ", tensors.size());
  TORCH_CHECK(size_ > 1, "tdx: recv from any source in a group of size 1 would wait forever");
  if (auto dev = cudaDeviceOf("recv", tensors)) return cudaP2P(*dev, c10d::OpType::RECVANYSOURCE, tensors[0], -1, tag);
  if (hier_) {
    checkAlive("recv");
    checkTensor("recv", tensors[0]);
    return hier_->recv(tensors[0], -1, tag);
  }
  return enqueueP2P(c10d::OpType::RECVANYSOURCE, "recv", tensors[0], -1, tag);
}

c10::intrusive_ptr<c10d::Work> TdxBackend::barrier(const c10d::BarrierOptions& opts) {
  return enqueue(c10d::OpType::BARRIER, "barrier", {}, isAsyncOp(opts),
                 [this](const WaitContext& ctx) {
                   if (hier_) {
                     hier_->barrier(ctx);
                   } else {
                     tdx::barrier(*group_, ctx);
                   }
                 });
}

}  // namespace tdx
