// tdx's calls in a flight recorder of torch's own kind (c10d::FlightRecorder, the ring buffer
// torch's gloo and NCCL backends fill), so a hang or a desync can be read afterwards with torch's
// trace analyzer (`python -m torchdist_ext.fr_trace DIR`, which is torch's with tdx accepted).
//
// torch keeps its own recorder inside libtorch and does not export it, so tdx fills one of the same
// type and format in this library: torchdist_ext.dump_fr_trace() / dump_fr_trace_json() return it
// as torch's _dump_fr_trace() / _dump_fr_trace_json() return theirs.
//
// Off unless TORCH_FR_BUFFER_SIZE (or TORCH_NCCL_TRACE_BUFFER_SIZE) is set above 0 when the first
// tdx group is made (torch's gloo records by default; a record captures the caller's Python stack,
// microseconds that tdx's small calls cannot carry unasked). When on: one entry per collective and
// point-to-point call (group, sequence number, inputs' and outputs' sizes and dtypes, the caller's
// stack), retired when its Work completes; the first call that fails for a peer (timeout, a peer
// gone; not one ended by the group's own shutdown) writes the buffer once per process through
// torch's DebugInfoWriter, to
// TORCH_FR_DUMP_TEMP_FILE<global rank> (torch's default ~/.cache/torch/comm_lib_trace_rank_<rank>),
// as NCCL does on its watchdog timeout.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/logger.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace tdx {
namespace trace {

// Whether tdx records its calls (read once, see above).
bool enabled();

// `ts` when recording, else an empty list: what a call passes for the recorder to note, without
// building a list on every call while it is off.
inline std::vector<at::Tensor> noted(std::initializer_list<at::Tensor> ts) {
  return enabled() ? std::vector<at::Tensor>(ts) : std::vector<at::Tensor>{};
}

// One recorded call, held by its Work's completion callback.
class Call {
 public:
  Call(std::optional<size_t> id, std::shared_ptr<c10d::ProcessGroupStatus> status, int64_t seq, bool collective,
       int globalRank, std::shared_ptr<std::atomic<bool>> closed)
      : id_(id),
        status_(std::move(status)),
        seq_(seq),
        collective_(collective),
        globalRank_(globalRank),
        closed_(std::move(closed)) {}
  // The call completed: its entry retires, the group's last completed collective advances.
  void completed();
  // The call failed: a failure of the group (timeout, peer gone, abort) writes the dump once
  // per process; `err` null or another error (e.g. bad input) writes nothing.
  void failed(const std::exception_ptr& err);

 private:
  std::optional<size_t> id_;
  std::shared_ptr<c10d::ProcessGroupStatus> status_;
  int64_t seq_;
  bool collective_;
  int globalRank_;
  std::shared_ptr<std::atomic<bool>> closed_;  // the group's: set when it is shut down here
};

// A group's side of the recorder: its id, name and ranks in the dump, its status.
class GroupRecorder {
 public:
  // `rank`: this process's rank in the group of `size`; `globalRanks`: the group's ranks in the
  // default group (index = group rank; empty: the default group itself).
  GroupRecorder(int rank, int size, const std::vector<int64_t>& globalRanks);
  // Records the call `name` (tdx's name of the operation) of sequence number `seq`; `p2p` with
  // `peer` the other group rank of a send or receive. `groupName` / `groupDesc`: torch's
  // (Backend::getGroupUid / getGroupDesc, set after the backend is made).
  // The group is being shut down here (destroy_process_group, not an abort): the calls it ends
  // write no dump.
  void close() { closed_->store(true); }
  std::shared_ptr<Call> record(const std::string& groupName, const std::string& groupDesc, const char* name,
                               uint64_t seq, bool p2p, int peer, const std::vector<at::Tensor>& inputs,
                               const std::vector<at::Tensor>& outputs, std::chrono::milliseconds timeout);

 private:
  size_t pgId_;
  int rank_;
  std::vector<uint64_t> ranks_;
  std::tuple<std::string, std::string> registered_;  // the name whose ranks the recorder has
  bool hasRegistered_ = false;
  uint64_t ops_ = 0;
  std::shared_ptr<c10d::ProcessGroupStatus> status_;
  std::shared_ptr<std::atomic<bool>> closed_;
};

// Writes the recorder (with the callers' stacks unless TORCH_INCLUDE_STACK_TRACE=0; only the calls
// not completed with TORCH_INCLUDE_ONLY_ACTIVE=1) through torch's DebugInfoWriter for `globalRank`,
// making its folder; returns the file's path (TORCH_FR_DUMP_TEMP_FILE<rank>, torch's default
// ~/.cache/torch/comm_lib_trace_rank_<rank>). Raises if the file could not be written.
std::string write(int globalRank);

// The recorder's content, pickled in torch's layout (torch's _dump_fr_trace; the JSON form is made
// from it in Python).
std::string dump(bool includeCollectives, bool includeStackTraces, bool onlyActive);

// The name torch's trace analyzer knows for tdx's operation `name` (e.g. all_gather_into_tensor is
// _all_gather_base, as gloo records it).
std::string profilingName(const char* name, bool p2p, int rank, int peer);

}  // namespace trace
}  // namespace tdx
