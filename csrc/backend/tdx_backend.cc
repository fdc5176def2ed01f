// TdxBackend: construction (the host engine and the route table), shutdown, the shared steps of
// every call (context, route, coalescing), point-to-point and barrier. Collectives: tdx_collectives.cc.
#include "backend/tdx_backend.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>

#include <c10/util/Exception.h>

#include "backend/host_engine.h"
#include "backend/store_rendezvous.h"
#include "backend/tensor_utils.h"
#include "backend/work.h"
#include "common/env.h"
#include "common/logging.h"
#include "common/round_up.h"
#include "tuning/plan.h"

namespace tdx {

namespace {

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

shm::ShmOptions shmOptions(int localSize, bool multiHost) {
  const EnvKnobs& knobs = env();
  shm::ShmOptions opts;
  opts.halfBytes = roundUp<size_t>(knobs.bufferBytes, 64);
  opts.ringBytes = roundUp<size_t>(knobs.p2pRingBytes, 64);
  tuning::Knobs waitKnobs;  // only the wait's (the others are checked where a collective plans)
  waitKnobs.spinUs = knobs.spinUs;
  waitKnobs.yieldUs = knobs.yieldUs;
  const tuning::ShmWait wait = tuning::shmWait(localSize, availableCores(), multiHost, waitKnobs);
  opts.wait.spinTime = std::chrono::microseconds(wait.spinUs);
  opts.wait.yieldTime = std::chrono::microseconds(wait.yieldUs);
  return opts;
}

std::unique_ptr<shm::ShmGroup> makeShmGroup(const GroupInfo& info, Rendezvous& rdv, const shm::ShmOptions& opts) {
  std::unique_ptr<shm::ShmGroup> group;
  try {
    group = std::make_unique<shm::ShmGroup>(info, rdv, opts);
  } catch (const Error& e) {
    TORCH_CHECK(false, e.what());
  }
  return group;
}

}  // namespace

TdxBackend::TdxBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                       std::chrono::milliseconds timeout, std::string groupName, std::vector<int64_t> globalRanks,
                       std::vector<std::string> nodeIds, c10::intrusive_ptr<c10d::Backend> glooAll,
                       c10::intrusive_ptr<c10d::Backend> glooSlice)
    : c10d::Backend(rank, size), timeout_(timeout) {
  info_.rank = rank;
  info_.size = size;
  info_.name = groupName.empty() ? "default" : groupName;
  info_.globalRanks = std::move(globalRanks);
  TORCH_CHECK_VALUE(static_cast<int>(nodeIds.size()) == size, "tdx: got ", nodeIds.size(), " node ids for a group of ",
                    size, " ranks");
  const HostLayout layout = computeHostLayout(nodeIds, rank);
  std::unique_ptr<HostEngine> host;
  if (layout.numHosts > 1) {
    TORCH_CHECK(glooAll, "tdx: rank ", info_.describeRank(rank), " runs on host '", nodeIds[rank],
                "' but the group spans ", layout.numHosts, " hosts, and no Gloo group was given for the cross-host "
                "part; create tdx process groups through torch.distributed after `import torchdist_ext`");
    GroupInfo local = info_;
    local.rank = layout.localRank;
    local.size = layout.localSize;
    local.name = str(info_.name, "/host", layout.hostIndex);
    local.globalRanks.clear();
    for (int r : layout.localRanks) local.globalRanks.push_back(info_.globalRanks.empty() ? r : info_.globalRanks[r]);
    StoreRendezvous hostRdv(store, str("tdx/host", layout.hostIndex, "/"));
    auto group = makeShmGroup(local, hostRdv, shmOptions(local.size, true));
    // All p2p goes through Gloo (one matching engine, so any-source receives work).
    host = std::make_unique<HierarchicalEngine>(
        std::move(group), CrossHost{layout, GlooGroups{glooAll, glooSlice}, store, nodeIds, info_.globalRanks}, rank,
        size);
  } else {
    StoreRendezvous rdv(store);
    host = std::make_unique<ShmEngine>(makeShmGroup(info_, rdv, shmOptions(size, false)), rank);
  }
  routes_ = std::make_unique<Routes>(std::move(host), store, info_, std::move(nodeIds));
  if (trace::enabled()) recorder_ = std::make_unique<trace::GroupRecorder>(rank, size, info_.globalRanks);
  groupsChanged();
}

TdxBackend::~TdxBackend() { shutdown(); }

bool TdxBackend::spansHosts() const {
  const auto& ids = routes_->nodeIds();
  return std::any_of(ids.begin(), ids.end(), [&](const std::string& id) { return id != ids.front(); });
}

c10::intrusive_ptr<c10d::Backend::Options> TdxBackend::getBackendOptions() {
  return c10::make_intrusive<c10d::Backend::Options>("tdx", timeout_);
}

void TdxBackend::shutdown() {
  if (shutdown_.exchange(true)) return;
  groupsChanged();
  if (recorder_) recorder_->close();  // calls ended by a shutdown write no flight recorder dump
  routes_->shutdown();
}

void TdxBackend::abort() {
  groupsChanged();
  routes_->abort();
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

Engine& TdxBackend::route(const char* op, std::optional<at::Device> device, Reduction reduction) {
  checkAlive(op);
  return routes_->pick(op, device, reduction, coalescing_, collSeq_ + 1, timeout_);
}

TdxBackend::Issued TdxBackend::context(const char* name, c10d::OpType type, const Tensors& outputs, bool asyncOp,
                                       bool p2p, const Tensors& inputs, int peer, bool wantsWork) {
  Issued c;
  c.op.name = name;
  c.op.type = type;
  c.op.seq = p2p ? ++p2pSeq_ : ++collSeq_;
  c.op.asyncOp = asyncOp;
  c.op.wantsWork = wantsWork;
  c.op.timeout = timeout_;
  if (wantsWork) c.op.outputs = outputs;
  if (recorder_) {
    c.record = recorder_->record(getGroupUid(), getGroupDesc(), name, c.op.seq, p2p, peer,
                                 inputs.empty() ? outputs : inputs, outputs, timeout_);
  }
  return c;
}

size_t TdxBackend::singleCopyBytes() const { return routes_->host().singleCopyBytes(); }

c10::intrusive_ptr<c10d::Work> TdxBackend::track(c10::intrusive_ptr<c10d::Work> w,
                                                 std::shared_ptr<trace::Call> record) {
  if (coalescing_) coalesced_.push_back(w);
  if (record) {
    c10::intrusive_ptr<c10::ivalue::Future> future;
    try {
      future = w->getFuture();
    } catch (const std::exception&) {  // a Work without a future: the entry stays "scheduled"
    }
    if (future) {
      future->addCallback([record = std::move(record)](c10::ivalue::Future& f) {
        if (f.hasError()) {
          record->failed(f.exception_ptr());
        } else {
          record->completed();
        }
      });
    }
  }
  return w;
}

c10::intrusive_ptr<c10d::Work> TdxBackend::p2p(c10d::OpType type, std::vector<at::Tensor>& tensors, int peer,
                                               int tag) {
  const bool isSend = type == c10d::OpType::SEND;
  const char* name = isSend ? "send" : "recv";
  TORCH_CHECK_VALUE(tensors.size() == 1, "tdx: ", name, " takes exactly one tensor, got ", tensors.size());
  if (type == c10d::OpType::RECVANYSOURCE) {
    TORCH_CHECK(size_ > 1, "tdx: recv from any source in a group of size 1 would wait forever");
  } else {
    checkPeer(name, peer);
  }
  const auto dev = cudaDeviceOf(name, tensors);
  (dev ? checkDeviceTensor : checkTensor)(name, tensors[0], "tensor");
  Engine& engine = route(name, dev);
  TORCH_CHECK(!dev || peer >= 0 || &engine != routes_->device(), "tdx: recv from any source is not possible for "
              "CUDA tensors on the NCCL path (NCCL must know the sender); pass src=, or set TDX_CUDA_PATH=staged to "
              "move CUDA tensors through host memory");
  const Issued c = context(name, type, tensors, true, /*p2p=*/true, tensors, peer);
  P2PArgs a{tensors[0], peer, tag};
  return track(isSend ? engine.send(std::move(a), c.op) : engine.recv(std::move(a), c.op), c.record);
}

c10::intrusive_ptr<c10d::Work> TdxBackend::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  return p2p(c10d::OpType::SEND, tensors, dstRank, tag);
}

c10::intrusive_ptr<c10d::Work> TdxBackend::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  return p2p(c10d::OpType::RECV, tensors, srcRank, tag);
}

c10::intrusive_ptr<c10d::Work> TdxBackend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  return p2p(c10d::OpType::RECVANYSOURCE, tensors, -1, tag);
}

c10::intrusive_ptr<c10d::Work> TdxBackend::barrier(const c10d::BarrierOptions& opts) {
  Engine& engine = route("barrier", std::nullopt);
  const Issued c = context("barrier", c10d::OpType::BARRIER, {}, isAsyncOp(opts));
  return track(engine.barrier(c.op), c.record);
}

void TdxBackend::startCoalescing() {
  TORCH_CHECK(!coalescing_, "tdx: start_coalescing called twice in group '", info_.name, "' without end_coalescing");
  coalescing_ = true;
}

c10::intrusive_ptr<c10d::Work> TdxBackend::endCoalescing() {
  TORCH_CHECK(coalescing_, "tdx: end_coalescing without start_coalescing in group '", info_.name, "'");
  coalescing_ = false;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  works.swap(coalesced_);
  if (DeviceEngine* device = routes_->device(); device && device->coalescing()) {
    return device->endCoalescing(++collSeq_, timeout_);
  }
  // Host (and staged) operations ran as they came; the block's Work is done when all are.
  std::vector<at::Tensor> outputs;
  for (auto& w : works) {
    w->wait();
    for (auto& t : w->result()) outputs.push_back(t);
  }
  std::vector<c10::Device> devices;
  for (const auto& t : outputs) {
    if (t.is_cuda() && std::find(devices.begin(), devices.end(), t.device()) == devices.end()) {
      devices.push_back(t.device());
    }
  }
  auto work = c10::make_intrusive<TdxWork>(rank_, c10d::OpType::COALESCED, collSeq_, "coalesced", outputs,
                                           std::nullopt, devices);
  work->complete(nullptr);
  return work;
}

}  // namespace tdx
