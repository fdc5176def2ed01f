#include "backend/flight_recorder.h"

#include <Python.h>
#include <sys/prctl.h>

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <torch/csrc/distributed/c10d/FlightRecorder.hpp>
#include <torch/csrc/distributed/c10d/TraceUtils.h>
#include <torch/csrc/profiler/combined_traceback.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "common/logging.h"

namespace tdx {
namespace trace {

namespace {

// The buffer size asked for: TORCH_FR_BUFFER_SIZE, else TORCH_NCCL_TRACE_BUFFER_SIZE; 0 when
// neither is set (tdx records only when asked, see flight_recorder.h).
size_t askedEntries() {
  for (const char* name : {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}) {
    const char* v = std::getenv(name);
    if (v != nullptr && *v != '\0') {
      const long n = std::strtol(v, nullptr, 10);
      return n > 0 ? static_cast<size_t>(n) : 0;
    }
  }
  return 0;
}

struct Entry {
  size_t id = 0;
  size_t pgId = 0;
  std::tuple<std::string, std::string> pgName;
  uint64_t collSeq = 0, p2pSeq = 0, opId = 0;
  std::string profilingName;
  std::shared_ptr<torch::CapturedTraceback> traceback;
  int64_t created = 0;    // ns since the epoch
  int64_t completed = 0;  // ns since the epoch; 0 while not completed
  int64_t timeoutMs = 0;
  bool p2p = false;
  bool retired = false;
  std::vector<std::vector<int64_t>> inputSizes, outputSizes;
  std::vector<std::string> inputDtypes, outputDtypes;
  std::string threadId, threadName;
};

int64_t nowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// The process's ring buffer of entries (torch's FlightRecorder keeps the same fields).
class Recorder {
 public:
  static Recorder& get() {
    static auto* r = new Recorder();  // never destroyed: Works may retire entries at exit
    return *r;
  }
  size_t nextPgId() { return pgIds_++; }

  void registerGroup(const std::tuple<std::string, std::string>& name, std::vector<uint64_t> ranks) {
    std::lock_guard<std::mutex> lock(mu_);
    pgRanks_[name] = std::move(ranks);
  }

  std::optional<size_t> record(Entry e, size_t pgId, const std::shared_ptr<c10d::ProcessGroupStatus>& status,
                               const char* name) {
    std::lock_guard<std::mutex> lock(mu_);
    if (pgStatus_.find(pgId) == pgStatus_.end()) pgStatus_.emplace(pgId, status);
    if (!e.p2p) {
      status->lastEnqueuedSeq = static_cast<int64_t>(e.collSeq);
      status->lastEnqueuedWorkName = name;
    }
    e.id = nextId_++;
    const size_t slot = e.id % capacity_;
    if (entries_.size() < capacity_) {
      entries_.push_back(std::move(e));
    } else {
      entries_[slot] = std::move(e);
    }
    return entries_[slot].id;
  }

  // The group's status fields change under the buffer's lock too (dump() reads them under it).
  void retire(std::optional<size_t> id, c10d::ProcessGroupStatus* status, int64_t seq) {
    std::lock_guard<std::mutex> lock(mu_);
    if (status != nullptr) status->lastCompletedSeq = std::max(status->lastCompletedSeq, seq);
    if (!id || entries_.empty()) return;
    Entry& e = entries_[*id % capacity_];
    if (e.id != *id) return;  // overwritten since
    e.retired = true;
    e.completed = nowNs();
  }

  // torch's dump layout (FlightRecorder::dump, version 2.10): version, pg_config, pg_status,
  // comm_lib_version, entries.
  c10::Dict<c10::IValue, c10::IValue> dump(bool includeCollectives, bool includeStackTraces, bool onlyActive) {
    std::vector<Entry> entries;
    auto out = c10d::new_dict();
    auto config = c10d::new_dict();
    auto status = c10d::new_dict();
    {
      std::lock_guard<std::mutex> lock(mu_);
      const size_t first = entries_.size() < capacity_ ? 0 : nextId_ % capacity_;
      for (size_t i = 0; i < entries_.size(); ++i) entries.push_back(entries_[(first + i) % entries_.size()]);
      for (const auto& [name, ranks] : pgRanks_) {
        auto info = c10d::new_dict();
        info.insert("name", std::get<0>(name));
        info.insert("desc", std::get<1>(name));
        // torch's c10d::ranks_str formats with fmt, which libtorch does not export to extensions
        std::ostringstream r;
        r << "[";
        for (size_t i = 0; i < ranks.size(); ++i) r << (i ? ", " : "") << ranks[i];
        r << "]";
        info.insert("ranks", r.str());
        config.insert(std::get<0>(name), info);
      }
      for (const auto& [id, s] : pgStatus_) {
        auto st = c10d::new_dict();
        st.insert("last_enqueued_collective", s->lastEnqueuedSeq);
        st.insert("last_started_collective", s->lastStartedSeq);
        st.insert("last_completed_collective", s->lastCompletedSeq);
        status.insert(std::to_string(id), st);
      }
    }
    out.insert("version", "2.10");
    out.insert("pg_config", config);
    out.insert("pg_status", status);
    out.insert("comm_lib_version", "");
    if (includeCollectives) out.insert("entries", entriesList(entries, includeStackTraces, onlyActive));
    return out;
  }

 private:
  explicit Recorder() : capacity_(std::max<size_t>(askedEntries(), 1)) {}

  static c10::List<c10::IValue> entriesList(const std::vector<Entry>& entries, bool stacks, bool onlyActive) {
    auto list = c10d::new_list();
    std::vector<c10::IValue> frames;
    torch::SymbolizedTracebacks symbolized;
    if (stacks) {
      std::vector<torch::CapturedTraceback*> tbs;
      for (const auto& e : entries) tbs.push_back(e.traceback.get());
      symbolized = torch::symbolize(tbs);
      for (const auto& f : symbolized.all_frames) {
        auto d = c10d::new_dict();
        d.insert("name", f.funcname);
        d.insert("filename", f.filename);
        d.insert("line", static_cast<int64_t>(f.lineno));
        frames.emplace_back(d);
      }
    }
    auto sizes = [](const std::vector<std::vector<int64_t>>& s) {
      auto l = c10d::new_list();
      for (const auto& dims : s) l.push_back(c10::List<int64_t>(dims));
      return l;
    };
    for (size_t i = 0; i < entries.size(); ++i) {
      const Entry& e = entries[i];
      if (onlyActive && e.completed != 0) continue;
      auto d = c10d::new_dict();
      if (stacks) {
        auto fl = c10d::new_list();
        for (auto f : symbolized.tracebacks.at(i)) fl.push_back(frames.at(f));
        d.insert("frames", fl);
      }
      d.insert("record_id", static_cast<int64_t>(e.id));
      d.insert("pg_id", static_cast<int64_t>(e.pgId));
      d.insert("process_group", c10::ivalue::Tuple::create(std::get<0>(e.pgName), std::get<1>(e.pgName)));
      d.insert("thread_name", e.threadName);
      d.insert("thread_id", e.threadId);
      d.insert("collective_seq_id", static_cast<int64_t>(e.collSeq));
      d.insert("p2p_seq_id", static_cast<int64_t>(e.p2pSeq));
      d.insert("op_id", static_cast<int64_t>(e.opId));
      d.insert("profiling_name", e.profilingName);
      d.insert("time_created_ns", e.created);
      d.insert("input_sizes", sizes(e.inputSizes));
      d.insert("input_dtypes", c10::List<std::string>(e.inputDtypes));
      d.insert("output_sizes", sizes(e.outputSizes));
      d.insert("output_dtypes", c10::List<std::string>(e.outputDtypes));
      // tdx runs a call when it is issued (or queued behind the group's earlier ones): "completed"
      // once its Work has, else "scheduled" (torch's states).
      d.insert("state", e.completed != 0 ? "completed" : "scheduled");
      d.insert("time_discovered_started_ns", c10::IValue());
      d.insert("time_discovered_completed_ns", e.completed != 0 ? c10::IValue(e.completed) : c10::IValue());
      d.insert("retired", e.retired);
      d.insert("timeout_ms", e.timeoutMs);
      d.insert("is_p2p", e.p2p);
      list.push_back(d);
    }
    return list;
  }

  const size_t capacity_;
  std::mutex mu_;
  std::vector<Entry> entries_;
  size_t nextId_ = 0;
  std::atomic<size_t> pgIds_{0};
  std::map<std::tuple<std::string, std::string>, std::vector<uint64_t>> pgRanks_;
  std::map<size_t, std::shared_ptr<c10d::ProcessGroupStatus>> pgStatus_;
};

void describe(const std::vector<at::Tensor>& ts, std::vector<std::vector<int64_t>>& sizes,
              std::vector<std::string>& dtypes) {
  for (const auto& t : ts) {
    sizes.emplace_back(t.sizes().begin(), t.sizes().end());
    dtypes.emplace_back(c10::toString(t.scalar_type()));
  }
}

// The list forms as NCCL records them, which torch's analyzer checks (an all_gather's output and a
// reduce_scatter's input hold world-size times the other side): one [ranks, *shape] per list
// instead of the list's tensors; an all_gather whose blocks differ in size, as one flat size.
void shapeLists(const char* name, size_t ranks, const std::vector<at::Tensor>& inputs,
                const std::vector<at::Tensor>& outputs, Entry& e) {
  const std::string op = name;
  if (op == "all_gather" && outputs.size() == inputs.size() * ranks) {
    const size_t n = ranks;
    e.outputSizes.clear();
    e.outputDtypes.clear();
    for (size_t i = 0; i < inputs.size(); ++i) {
      int64_t total = 0;
      bool even = true;
      for (size_t p = 0; p < n; ++p) {
        total += outputs[i * n + p].numel();
        even = even && outputs[i * n + p].numel() == inputs[i].numel();
      }
      std::vector<int64_t> shape{static_cast<int64_t>(n)};
      shape.insert(shape.end(), inputs[i].sizes().begin(), inputs[i].sizes().end());
      e.outputSizes.push_back(even ? shape : std::vector<int64_t>{total});
      e.outputDtypes.emplace_back(c10::toString(outputs[i * n].scalar_type()));
    }
  } else if (op == "reduce_scatter") {  // recorded with its outputs as inputs (TdxBackend::reduce_scatter)
    for (auto& shape : e.inputSizes) shape.insert(shape.begin(), static_cast<int64_t>(ranks));
  }
}

// torch's spelling of a boolean variable (getCvarBool): unset is `def`.
bool envFlag(const char* name, bool def) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return def;
  std::string s(v);
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return !(s == "0" || s == "false" || s == "no" || s == "off");
}

// Whether the callers' Python stacks can be read now: symbolizing them takes the GIL, which an
// interpreter that is shutting down may never hand out.
bool pythonAlive() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}


}  // namespace

bool enabled() {
  static const bool on = askedEntries() > 0;
  return on;
}

void Call::completed() { Recorder::get().retire(id_, collective_ ? status_.get() : nullptr, seq_); }

void Call::failed(const std::exception_ptr& err) {
  if (!err || (closed_ && closed_->load())) return;  // no dump for calls a local shutdown ended
  try {
    std::rethrow_exception(err);
  } catch (const c10::DistBackendError&) {  // the group failed (timeout, a peer gone, an abort)
  } catch (const Error&) {
  } catch (...) {
    return;
  }
  static std::once_flag once;
  std::call_once(once, [&] {
    try {
      const std::string path = write(globalRank_);
      std::fprintf(stderr, "tdx: flight recorder written to %s (a call failed); read every rank's file with: "
                   "python -m torchdist_ext.fr_trace <their folder>\n", path.c_str());
    } catch (const std::exception& e) {
      std::fprintf(stderr, "tdx: could not write the flight recorder: %s\n", e.what());
    }
  });
}

std::string write(int globalRank) {
  auto& writer = c10d::DebugInfoWriter::getWriter(globalRank);
  const std::filesystem::path target = writer.getWriterTarget();
  if (target.has_parent_path()) std::filesystem::create_directories(target.parent_path());
  const bool stacks = envFlag("TORCH_INCLUDE_STACK_TRACE", true) && pythonAlive();
  std::filesystem::remove(target);
  writer.write(dump(true, stacks, envFlag("TORCH_INCLUDE_ONLY_ACTIVE", false)));
  // torch's writer logs a file it cannot open instead of raising
  TORCH_CHECK(std::filesystem::exists(target), "tdx: the flight recorder could not be written to ", target.string());
  return target.string();
}

GroupRecorder::GroupRecorder(int rank, int size, const std::vector<int64_t>& globalRanks)
    : pgId_(Recorder::get().nextPgId()),
      rank_(rank),
      status_(std::make_shared<c10d::ProcessGroupStatus>()),
      closed_(std::make_shared<std::atomic<bool>>(false)) {
  for (int r = 0; r < size; ++r) {
    ranks_.push_back(static_cast<uint64_t>(globalRanks.empty() ? r : globalRanks.at(r)));
  }
}

std::shared_ptr<Call> GroupRecorder::record(const std::string& groupName, const std::string& groupDesc,
                                            const char* name, uint64_t seq, bool p2p, int peer,
                                            const std::vector<at::Tensor>& inputs,
                                            const std::vector<at::Tensor>& outputs,
                                            std::chrono::milliseconds timeout) {
  auto pgName = std::make_tuple(groupName, groupDesc);
  if (!hasRegistered_ || pgName != registered_) {  // torch names the group after making its backend
    Recorder::get().registerGroup(pgName, ranks_);
    registered_ = pgName;
    hasRegistered_ = true;
  }
  Entry e;
  e.pgId = pgId_;
  e.pgName = std::move(pgName);
  (p2p ? e.p2pSeq : e.collSeq) = seq;
  e.opId = ++ops_;
  e.profilingName = profilingName(name, p2p, rank_, peer);
  e.traceback = torch::CapturedTraceback::gather(/*python=*/true, /*script=*/true, /*cpp=*/false);
  e.created = nowNs();
  e.timeoutMs = timeout.count();
  e.p2p = p2p;
  describe(inputs, e.inputSizes, e.inputDtypes);
  describe(outputs, e.outputSizes, e.outputDtypes);
  shapeLists(name, ranks_.size(), inputs, outputs, e);
  thread_local const std::pair<std::string, std::string> thread = [] {
    std::ostringstream id;
    id << std::this_thread::get_id();
    char name[17] = {};
    prctl(PR_GET_NAME, name, 0, 0, 0);  // the thread's name, as torch records it (c10::getThreadName)
    return std::make_pair(id.str(), std::string(name));
  }();
  e.threadId = thread.first;
  e.threadName = thread.second;
  const int globalRank = static_cast<int>(ranks_.at(rank_));
  return std::make_shared<Call>(Recorder::get().record(std::move(e), pgId_, status_, name), status_,
                                static_cast<int64_t>(seq), !p2p, globalRank, closed_);
}

std::string dump(bool includeCollectives, bool includeStackTraces, bool onlyActive) {
  return c10d::pickle_str(Recorder::get().dump(includeCollectives, includeStackTraces, onlyActive));
}

std::string profilingName(const char* name, bool p2p, int rank, int peer) {
  std::string op = name;
  // torch's names for the c10d methods behind all_gather_into_tensor / reduce_scatter_tensor (what
  // gloo records and torch's analyzer knows), and for the direct ops (torch.ops.tdx.*).
  if (op == "all_gather_into_tensor" || op == "all_gather_into_tensor_") op = "_all_gather_base";
  if (op == "reduce_scatter_tensor" || op == "reduce_scatter_tensor_") op = "_reduce_scatter_base";
  if (op == "all_reduce_") op = "all_reduce";
  if (p2p) op += op == "send" ? str(" ", rank, "->", peer) : str(" ", rank, "<-", peer);
  return "tdx:" + op;
}

}  // namespace trace
}  // namespace tdx
