#include "cuda/nccl_path.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <cstdio>

#include "backend/store_rendezvous.h"
#include "common/logging.h"

namespace tdx {

namespace {

std::exception_ptr backendError(const std::string& msg) {
  return std::make_exception_ptr(c10::DistBackendError(c10::SourceLocation{__func__, __FILE__, __LINE__}, msg));
}

void recordStream(const at::Tensor& t, const c10::cuda::CUDAStream& stream) {
  if (t.defined() && t.is_cuda() && t.storage().data_ptr().get()) {
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream);
  }
}

char* bytePtr(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

}  // namespace

std::string gpuIdentity(int device) {
  cudaDeviceProp prop;
  nccl::checkCuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  char uuid[64];
  const unsigned char* u = reinterpret_cast<const unsigned char*>(prop.uuid.bytes);
  std::snprintf(uuid, sizeof(uuid), "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0],
                u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
  bool zero = true;
  for (int i = 0; i < 16; ++i) zero = zero && u[i] == 0;
  if (!zero) return uuid;
  char bus[32] = {0};
  nccl::checkCuda(cudaDeviceGetPCIBusId(bus, sizeof(bus), device), "cudaDeviceGetPCIBusId");
  return bus;
}

NcclPath::NcclPath(c10::intrusive_ptr<c10d::Store> store, GroupInfo info, at::Device device)
    : store_(std::move(store)),
      info_(std::move(info)),
      device_(device),
      stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device.index())) {
  StoreRendezvous rdv(store_);
  try {
    comm_ = std::make_unique<nccl::NcclComm>(rdv, "tdx/cuda/nccl_id", info_.rank, info_.size, device.index());
  } catch (const Error& e) {
    TORCH_CHECK(false, e.what(), " (creating the NCCL communicator of group '", info_.name, "' on ", device, ")");
  }
  watchdog_ = std::thread([this] { watch(); });
}

NcclPath::~NcclPath() { shutdown(); }

void NcclPath::shutdown() {
  if (stop_.exchange(true)) return;
  cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  bool busy;
  {
    std::lock_guard<std::mutex> lock(mu_);
    busy = false;
    for (auto& w : pending_) busy = busy || !w->finishedOnDevice();
  }
  // A communicator with queued work is aborted (destroying it would wait for peers that may be
  // gone); an idle one is destroyed normally by ~NcclComm.
  if (busy) comm_->abort();
}

void NcclPath::abort() {
  failAll(str("tdx: the CUDA communicator of group '", info_.name, "' was aborted"), false);
}

void NcclPath::checkUsable(const char* op, at::Device d) const {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_.empty()) {
      std::rethrow_exception(backendError(str("tdx: ", op, " refused: an earlier CUDA operation of group '",
                                              info_.name, "' failed, so the group's ranks no longer line up. "
                                              "First failure: ", failure_)));
    }
  }
  TORCH_CHECK_VALUE(d == device_, "tdx: ", op, ": tensors are on ", d, " but group '", info_.name,
                    "' runs its CUDA collectives on ", device_, " (fixed by its first CUDA collective); use one GPU "
                    "per rank and process group (torch.cuda.set_device(local_rank))");
}

NcclPath::InOut NcclPath::prepareInOut(const Tensors& inputs, const Tensors& outputs) {
  InOut io{prepare(inputs, true), prepare(outputs, false), {}};
  io.held = io.in.data;
  io.held.insert(io.held.end(), io.out.data.begin(), io.out.data.end());
  return io;
}

NcclPath::Prepared NcclPath::prepare(const Tensors& ts, bool copyIn) {
  Prepared p;
  for (const auto& t : ts) {
    if (t.is_contiguous()) {
      p.data.push_back(t);
    } else {
      at::Tensor c = copyIn ? t.contiguous() : at::empty(t.sizes(), t.options());
      p.data.push_back(c);
      p.copyBack.emplace_back(c, t);
    }
  }
  return p;
}

NcclPath::Ptr NcclPath::launch(const char* name, c10d::OpType type, uint64_t seq, std::chrono::milliseconds timeout,
                               Tensors outputs, Tensors held, std::vector<std::pair<at::Tensor, at::Tensor>> copyBack,
                               const Issue& issue) {
  c10::cuda::CUDAGuard guard(device_);
  // The communication stream waits for everything the caller queued so far (inputs are ready).
  at::cuda::CUDAEvent ready;
  ready.record(c10::cuda::getCurrentCUDAStream(device_.index()));
  ready.block(stream_);
  {
    c10::cuda::CUDAStreamGuard sg(stream_);
    if (!coalescing_) nccl::check(ncclGroupStart(), "ncclGroupStart", comm_->get());
    try {
      issue(comm_->get(), stream_.stream());
    } catch (...) {
      if (!coalescing_) ncclGroupEnd();
      throw;
    }
    if (!coalescing_) {
      nccl::check(ncclGroupEnd(), "ncclGroupEnd", comm_->get());
      for (auto& [tmp, user] : copyBack) user.copy_(tmp);
    }
  }
  for (const auto& t : held) recordStream(t, stream_);
  for (const auto& t : outputs) recordStream(t, stream_);
  for (const auto& [tmp, user] : copyBack) {
    recordStream(tmp, stream_);
    recordStream(user, stream_);
    held.push_back(tmp);
  }
  held.insert(held.end(), outputs.begin(), outputs.end());
  auto work = c10::make_intrusive<NcclWork>(info_.rank, type, seq, name, device_, outputs, held);
  if (coalescing_) {
    coalesced_.push_back(work);
    coalescedCopyBack_.insert(coalescedCopyBack_.end(), copyBack.begin(), copyBack.end());
    coalescedHeld_.insert(coalescedHeld_.end(), held.begin(), held.end());
    coalescedOutputs_.insert(coalescedOutputs_.end(), outputs.begin(), outputs.end());
    return work;
  }
  work->launched(stream_, timeout);
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back(work);
  }
  cv_.notify_all();
  return work;
}

void NcclPath::startCoalescing() {
  TORCH_CHECK(!coalescing_, "tdx: start_coalescing called twice without end_coalescing in group '", info_.name,
              "'");
  nccl::check(ncclGroupStart(), "ncclGroupStart", comm_->get());
  coalescing_ = true;
}

NcclPath::Ptr NcclPath::endCoalescing(uint64_t seq, std::chrono::milliseconds timeout) {
  TORCH_CHECK(coalescing_, "tdx: end_coalescing without start_coalescing in group '", info_.name, "'");
  coalescing_ = false;
  c10::cuda::CUDAGuard guard(device_);
  {
    c10::cuda::CUDAStreamGuard sg(stream_);
    nccl::check(ncclGroupEnd(), "ncclGroupEnd", comm_->get());
    for (auto& [tmp, user] : coalescedCopyBack_) user.copy_(tmp);
  }
  auto all = c10::make_intrusive<NcclWork>(info_.rank, c10d::OpType::COALESCED, seq, "coalesced", device_,
                                           std::move(coalescedOutputs_), std::move(coalescedHeld_));
  std::vector<c10::intrusive_ptr<NcclWork>> parts;
  parts.swap(coalesced_);
  coalescedCopyBack_.clear();
  coalescedHeld_.clear();
  coalescedOutputs_.clear();
  all->launched(stream_, timeout);
  for (auto& p : parts) p->launched(stream_, timeout);
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back(all);
    for (auto& p : parts) pending_.push_back(p);
  }
  cv_.notify_all();
  return all;
}

void NcclPath::synchronize() { stream_.synchronize(); }

NcclPath::Ptr NcclPath::allreduce(const Tensors& ts, DataType dt, ReduceOp op, uint64_t seq,
                                  std::chrono::milliseconds timeout) {
  auto p = prepare(ts, true);
  const auto type = nccl::toNcclType(dt);
  const auto rop = nccl::toNcclOp(op);
  return launch("all_reduce", c10d::OpType::ALLREDUCE, seq, timeout, ts, p.data, p.copyBack,
                [&](ncclComm_t comm, cudaStream_t s) {
                  for (auto& t : p.data) {
                    nccl::check(ncclAllReduce(t.data_ptr(), t.data_ptr(), t.numel(), type, rop, comm, s),
                                "ncclAllReduce", comm);
                  }
                });
}

NcclPath::Ptr NcclPath::reduce(const Tensors& ts, DataType dt, ReduceOp op, int root, uint64_t seq,
                               std::chrono::milliseconds timeout) {
  auto p = prepare(ts, true);
  if (info_.rank != root) p.copyBack.clear();  // only the root's tensors change
  const auto type = nccl::toNcclType(dt);
  const auto rop = nccl::toNcclOp(op);
  // Non-roots keep their input: NCCL writes the result only on the root, but reduces in place
  // there; on other ranks recvbuff is unused.
  return launch("reduce", c10d::OpType::REDUCE, seq, timeout, ts, p.data, p.copyBack,
                [&](ncclComm_t comm, cudaStream_t s) {
                  for (auto& t : p.data) {
                    nccl::check(ncclReduce(t.data_ptr(), t.data_ptr(), t.numel(), type, rop, root, comm, s),
                                "ncclReduce", comm);
                  }
                });
}

NcclPath::Ptr NcclPath::broadcast(const Tensors& ts, int root, uint64_t seq, std::chrono::milliseconds timeout) {
  auto p = prepare(ts, info_.rank == root);
  if (info_.rank == root) p.copyBack.clear();
  return launch("broadcast", c10d::OpType::BROADCAST, seq, timeout, ts, p.data, p.copyBack,
                [&](ncclComm_t comm, cudaStream_t s) {
                  for (auto& t : p.data) {
                    nccl::check(ncclBroadcast(t.data_ptr(), t.data_ptr(), t.nbytes(), ncclUint8, root, comm, s),
                                "ncclBroadcast", comm);
                  }
                });
}

NcclPath::Ptr NcclPath::allgatherFlat(const Tensors& outputs, const Tensors& inputs, const char* name,
                                      c10d::OpType type, uint64_t seq, std::chrono::milliseconds timeout) {
  const InOut io = prepareInOut(inputs, outputs);
  const Prepared &in = io.in, &out = io.out;
  const Tensors& held = io.held;
  return launch(name, type, seq, timeout, outputs, held, out.copyBack, [&](ncclComm_t comm, cudaStream_t s) {
    for (size_t i = 0; i < in.data.size(); ++i) {
      nccl::check(ncclAllGather(in.data[i].data_ptr(), out.data[i].data_ptr(), in.data[i].nbytes(), ncclUint8, comm, s),
                  "ncclAllGather", comm);
    }
  });
}

NcclPath::Ptr NcclPath::allgatherLists(const std::vector<Tensors>& outputLists, const Tensors& inputs, uint64_t seq,
                                       std::chrono::milliseconds timeout) {
  // Into one flat buffer per input, then copied out to the list on the communication stream.
  auto in = prepare(inputs, true);
  Tensors flats, outputs;
  std::vector<std::pair<at::Tensor, at::Tensor>> copyBack;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const int64_t n = in.data[i].numel();
    at::Tensor flat = at::empty({n * info_.size}, in.data[i].options());
    flats.push_back(flat);
    for (int r = 0; r < info_.size; ++r) {
      copyBack.emplace_back(flat.narrow(0, r * n, n).view(outputLists[i][r].sizes()), outputLists[i][r]);
      outputs.push_back(outputLists[i][r]);
    }
  }
  Tensors held = in.data;
  held.insert(held.end(), flats.begin(), flats.end());
  return launch("all_gather", c10d::OpType::ALLGATHER, seq, timeout, outputs, held, copyBack,
                [&](ncclComm_t comm, cudaStream_t s) {
                  for (size_t i = 0; i < in.data.size(); ++i) {
                    nccl::check(ncclAllGather(in.data[i].data_ptr(), flats[i].data_ptr(), in.data[i].nbytes(),
                                              ncclUint8, comm, s),
                                "ncclAllGather", comm);
                  }
                });
}

NcclPath::Ptr NcclPath::gather(const Tensors& outputs, const at::Tensor& input, int root, uint64_t seq,
                               std::chrono::milliseconds timeout) {
  return rooted("gather", c10d::OpType::GATHER, /*toRoot=*/true, outputs, {input}, root, seq, timeout);
}

NcclPath::Ptr NcclPath::scatter(const at::Tensor& output, const Tensors& inputs, int root, uint64_t seq,
                                std::chrono::milliseconds timeout) {
  return rooted("scatter", c10d::OpType::SCATTER, /*toRoot=*/false, {output}, inputs, root, seq, timeout);
}

NcclPath::Ptr NcclPath::rooted(const char* name, c10d::OpType type, bool toRoot, const Tensors& outputs,
                               const Tensors& inputs, int root, uint64_t seq, std::chrono::milliseconds timeout) {
  const InOut io = prepareInOut(inputs, outputs);
  const Prepared &in = io.in, &out = io.out;
  const Tensors& held = io.held;
  const int me = info_.rank;
  return launch(name, type, seq, timeout, outputs, held, out.copyBack, [&](ncclComm_t comm, cudaStream_t s) {
    // The root's per-rank blocks (gather: received, scatter: sent) and this rank's own tensor.
    const Tensors& blocks = toRoot ? out.data : in.data;
    const at::Tensor& mine = toRoot ? in.data[0] : out.data[0];
    auto move = [&](const at::Tensor& t, int peer, bool send) {
      if (send) {
        nccl::check(ncclSend(t.data_ptr(), t.nbytes(), ncclUint8, peer, comm, s), "ncclSend", comm);
      } else {
        nccl::check(ncclRecv(t.data_ptr(), t.nbytes(), ncclUint8, peer, comm, s), "ncclRecv", comm);
      }
    };
    if (me != root) return move(mine, root, /*send=*/toRoot);
    for (int r = 0; r < info_.size; ++r) {
      if (r != me) {
        move(blocks[r], r, /*send=*/!toRoot);
        continue;
      }
      const at::Tensor& dst = toRoot ? blocks[r] : mine;
      const at::Tensor& src = toRoot ? mine : blocks[r];
      nccl::checkCuda(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), src.nbytes(), cudaMemcpyDeviceToDevice, s),
                      "cudaMemcpyAsync");
    }
  });
}

NcclPath::Ptr NcclPath::reduceScatterFlat(const Tensors& outputs, const Tensors& inputs, DataType dt, ReduceOp op,
                                          const char* name, c10d::OpType type, uint64_t seq,
                                          std::chrono::milliseconds timeout) {
  const InOut io = prepareInOut(inputs, outputs);
  const Prepared &in = io.in, &out = io.out;
  const Tensors& held = io.held;
  const auto ntype = nccl::toNcclType(dt);
  const auto rop = nccl::toNcclOp(op);
  return launch(name, type, seq, timeout, outputs, held, out.copyBack, [&](ncclComm_t comm, cudaStream_t s) {
    for (size_t i = 0; i < in.data.size(); ++i) {
      nccl::check(ncclReduceScatter(in.data[i].data_ptr(), out.data[i].data_ptr(), out.data[i].numel(), ntype, rop,
                                    comm, s),
                  "ncclReduceScatter", comm);
    }
  });
}

NcclPath::Ptr NcclPath::alltoallBytes(const Tensors& outputs, const Tensors& inputs,
                                      const std::vector<int64_t>& outBytes, const std::vector<int64_t>& inBytes,
                                      const char* name, c10d::OpType type, uint64_t seq,
                                      std::chrono::milliseconds timeout) {
  // One flat input and output (all_to_all_single), or one tensor per rank (all_to_all).
  const InOut io = prepareInOut(inputs, outputs);
  const Prepared &in = io.in, &out = io.out;
  const Tensors& held = io.held;
  const bool flat = inputs.size() == 1 && outputs.size() == 1 && info_.size != 1;
  return launch(name, type, seq, timeout, outputs, held, out.copyBack, [&](ncclComm_t comm, cudaStream_t s) {
    int64_t ioff = 0, ooff = 0;
    for (int r = 0; r < info_.size; ++r) {
      char* src = flat || inputs.size() == 1 ? bytePtr(in.data[0]) + ioff : bytePtr(in.data[r]);
      char* dst = flat || outputs.size() == 1 ? bytePtr(out.data[0]) + ooff : bytePtr(out.data[r]);
      if (inBytes[r] > 0) nccl::check(ncclSend(src, inBytes[r], ncclUint8, r, comm, s), "ncclSend", comm);
      if (outBytes[r] > 0) nccl::check(ncclRecv(dst, outBytes[r], ncclUint8, r, comm, s), "ncclRecv", comm);
      ioff += inBytes[r];
      ooff += outBytes[r];
    }
  });
}

NcclPath::Ptr NcclPath::send(const at::Tensor& t, int peer, uint64_t seq, std::chrono::milliseconds timeout) {
  auto p = prepare({t}, true);
  return launch("send", c10d::OpType::SEND, seq, timeout, {t}, p.data, {}, [&](ncclComm_t comm, cudaStream_t s) {
    nccl::check(ncclSend(p.data[0].data_ptr(), p.data[0].nbytes(), ncclUint8, peer, comm, s), "ncclSend", comm);
  });
}

NcclPath::Ptr NcclPath::recv(const at::Tensor& t, int peer, uint64_t seq, std::chrono::milliseconds timeout) {
  auto p = prepare({t}, false);
  return launch("recv", c10d::OpType::RECV, seq, timeout, {t}, p.data, p.copyBack,
                [&](ncclComm_t comm, cudaStream_t s) {
                  nccl::check(ncclRecv(p.data[0].data_ptr(), p.data[0].nbytes(), ncclUint8, peer, comm, s),
                              "ncclRecv", comm);
                });
}

// ---- watchdog ----

std::string NcclPath::missingRanks(uint64_t seq) {
  // Every rank whose operation `seq` timed out posts a key; the ranks that have not posted within
  // a second are the ones that did not arrive (dead, stuck elsewhere, or in another collective).
  const std::string prefix = str("tdx/cuda/timeout/", seq, "/");
  try {
    store_->set(prefix + std::to_string(info_.rank), std::vector<uint8_t>{1});
  } catch (...) {
    return "unknown (the store is unreachable)";
  }
  std::vector<int> missing;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  do {
    missing.clear();
    for (int r = 0; r < info_.size; ++r) {
      bool posted = false;
      try {
        posted = store_->check({prefix + std::to_string(r)});
      } catch (...) {
      }
      if (!posted) missing.push_back(r);
    }
    if (missing.empty()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  } while (std::chrono::steady_clock::now() < until);
  return missing.empty() ? std::string("none (every rank reached it; NCCL itself is stuck)")
                         : info_.describeRanks(missing);
}

void NcclPath::failAll(const std::string& msg, bool /*timedOut*/) {
  std::list<c10::intrusive_ptr<NcclWork>> works;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_.empty()) failure_ = msg;
    works.swap(pending_);
  }
  comm_->abort();  // interrupts NCCL kernels waiting for peers
  auto err = backendError(msg);
  for (auto& w : works) w->fail(err);
}

void NcclPath::watch() {
  while (!stop_.load()) {
    c10::intrusive_ptr<NcclWork> late;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, std::chrono::milliseconds(pending_.empty() ? 100 : 2));
      for (auto it = pending_.begin(); it != pending_.end();) {
        if ((*it)->finishedOnDevice()) {
          it = pending_.erase(it);
        } else {
          if (!late && (*it)->pastDeadline()) late = *it;
          ++it;
        }
      }
      if (pending_.empty()) continue;
    }
    const std::string async = comm_->asyncError();
    if (!async.empty()) {
      c10::intrusive_ptr<NcclWork> first;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!pending_.empty()) first = pending_.front();
      }
      failAll(str("tdx: ", first ? first->name() : "a CUDA operation", " (sequence ",
                  first ? first->getSequencenumber() : 0, ") in group '", info_.name, "' failed on rank ",
                  info_.describeRank(info_.rank), " (CUDA, NCCL): ", async,
                  ". The process group cannot run collectives any more; destroy it and restart the job (or the "
                  "failed ranks)"),
              false);
      continue;
    }
    if (late) {
      const uint64_t seq = late->getSequencenumber();
      const std::string missing = missingRanks(seq);
      failAll(str("tdx: ", late->name(), " (sequence ", seq, ") in group '", info_.name, "' timed out on rank ",
                  info_.describeRank(info_.rank), " (CUDA, NCCL): ranks ", missing,
                  " did not arrive. They may have crashed, be stuck, or be running a different collective; "
                  "raise the timeout in init_process_group(timeout=...) if they are only slow"),
              true);
    }
  }
}

}  // namespace tdx

