// pybind11 module torchdist_ext._C: bindings only, no logic.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "backend/direct_ops.h"
#include "backend/flight_recorder.h"
#include "backend/tdx_backend.h"
#include "transport/shm/failure_notice.h"
#include "transport/shm/segment.h"

namespace py = pybind11;

namespace tdx {
void bindReducer(py::module& m);   // reducer_bindings.cc
void bindSharding(py::module& m);  // sharding_bindings.cc
void bindKernels(py::module& m);  // kernel_bindings.cc
void bindTensorParallel(py::module& m);  // tp_bindings.cc
void bindTuning(py::module& m);  // tuning_bindings.cc
}  // namespace tdx

namespace tdx {
int pendingStoreCalls();  // multihost/failure_notes.cc
}  // namespace tdx

PYBIND11_MODULE(_C, m) {
  m.doc() = "torchdist_ext native module: the tdx c10d backend";
  py::class_<tdx::TdxBackend, c10d::Backend, c10::intrusive_ptr<tdx::TdxBackend>>(m, "TdxBackend")
      .def_property_readonly("supports_shrinking", &tdx::TdxBackend::supportsShrinking,
                             "Whether dist.shrink_group works on this group (every tdx group; a group whose CUDA "
                             "tensors went through NCCL refuses the shrink, saying so).")
      .def(
          "_shrink_meeting",
          [](tdx::TdxBackend& self, const std::vector<int64_t>& ranksToExclude, int shrinkFlags,
             const c10::intrusive_ptr<c10d::Backend::Options>& optsOverride) {
            auto m = self.shrinkMeeting(ranksToExclude, shrinkFlags, optsOverride);
            return py::make_tuple(m.store, m.rank, m.size, m.timeout, m.nodeIds, m.exclude);
          },
          py::arg("ranks_to_exclude"), py::arg("shrink_flags") = 0, py::arg("opts_override") = nullptr,
          "(store, rank, size, timeout, node_ids, excluded) of the survivors of a shrink; torchdist_ext's "
          "shrink builds their Gloo groups from it, then calls _shrink_with.")
      .def(
          "_shrink_with",
          [](tdx::TdxBackend& self, const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
             std::chrono::milliseconds timeout, const std::vector<std::string>& nodeIds,
             const std::vector<int>& exclude, int shrinkFlags, const c10::intrusive_ptr<c10d::Backend>& glooAll,
             const c10::intrusive_ptr<c10d::Backend>& glooSlice) {
            return self.shrinkWith(tdx::TdxBackend::ShrinkMeeting{store, rank, size, timeout, nodeIds, exclude},
                                   shrinkFlags, glooAll, glooSlice);
          },
          py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"), py::arg("node_ids"),
          py::arg("excluded"), py::arg("shrink_flags"), py::arg("gloo_all") = nullptr,
          py::arg("gloo_slice") = nullptr, py::call_guard<py::gil_scoped_release>(),
          "The backend of the surviving ranks (collective over them), given the meeting of _shrink_meeting "
          "and the Gloo groups built for it (None on one host).")
      .def_property_readonly("single_copy_bytes", &tdx::TdxBackend::singleCopyBytes,
                             "From which output size all_gather reads the peers' inputs directly "
                             "(0: never; TDX_SINGLE_COPY_BYTES).")
      .def("gone_ranks", &tdx::TdxBackend::goneRanks, py::arg("note_wait"), py::call_guard<py::gil_scoped_release>(),
           "[(group rank, why)] for every rank whose process is gone or announced that it is failing (or, with a "
           "stuck time set, that was excluded for making no progress); waits up to note_wait for a note from "
           "another host when none is known here (the GIL released: the store may be Python's).")
      .def("set_stuck_timeout", &tdx::TdxBackend::setStuckTimeout, py::arg("seconds"),
           "A host mate that shows no progress for `seconds` while this rank waits on it is excluded (0: off).")
      .def("excluded", &tdx::TdxBackend::excluded,
           "'' unless this rank was excluded from the group by its peers; then why.")
      .def("interrupt", &tdx::TdxBackend::interrupt, py::arg("reason"), py::call_guard<py::gil_scoped_release>(),
           "Wakes every operation of this group waiting here with an error naming it and `reason`; the group "
           "refuses further operations (shrink it with SHRINK_ABORT).")
      .def("_shutdown_at_exit", &tdx::TdxBackend::shutdown, py::call_guard<py::gil_scoped_release>(),
           "Shuts the group down with the GIL released, so that its threads end now, running the Python "
           "callbacks of the operations they fail while the interpreter still runs (torchdist_ext calls it "
           "at exit for every tdx group still alive).")
      .def("failed_hosts", &tdx::TdxBackend::failedHosts,
           "Node ids of the hosts the last cross-host failure of this group named as failed or silent.")
      .def_property_readonly("spans_hosts", &tdx::TdxBackend::spansHosts,
                             "Whether the group's ranks are on more than one host (its p2p goes through Gloo); "
                             "a group made by shrink included.");
  m.def("pending_store_calls", &tdx::pendingStoreCalls,
        "How many calls of the cross-host failure notes into the group's store are still running (waited for "
        "at exit when the store is written in Python).");
  m.def(
      "create_backend",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout,
         const std::string& groupName, const std::vector<int64_t>& globalRanks,
         const std::vector<std::string>& nodeIds, const c10::intrusive_ptr<c10d::Backend>& glooAll,
         const c10::intrusive_ptr<c10d::Backend>& glooSlice) {
        return c10::make_intrusive<tdx::TdxBackend>(store, rank, size, timeout, groupName, globalRanks, nodeIds,
                                                    glooAll, glooSlice);
      },
      py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"), py::arg("group_name"),
      py::arg("global_ranks"), py::arg("node_ids"), py::arg("gloo_all") = nullptr,
      py::arg("gloo_slice") = nullptr, py::call_guard<py::gil_scoped_release>(),
      "Creates a tdx backend for one process group (called by torch.distributed through the registered creator).");
  m.def(
      "set_default_group_name",
      [](py::function fn) {
        // Kept for the life of the process (never released after the interpreter is gone).
        auto* keep = new py::function(std::move(fn));
        tdx::setDefaultGroupName([keep]() -> std::optional<std::string> {
          py::gil_scoped_acquire gil;
          py::object name = (*keep)();
          if (name.is_none()) return std::nullopt;
          return name.cast<std::string>();
        });
      },
      py::arg("fn"),
      "Registers fn() -> the default process group's group_name (None: no default group), which "
      "torch.ops.tdx.* use for group_name \"\".");
  m.def("remove_stale_segments", &tdx::shm::removeStaleSegments,
        "Removes /dev/shm segments left by tdx processes that no longer exist; returns how many.");
  m.def("note_process_failure", &tdx::shm::noteProcessFailure, py::arg("reason"),
        "Marks this rank failed in every live tdx group of the process (peers raise naming `reason`); "
        "returns how many groups were marked.");
  m.def("note_progress", &tdx::shm::noteProgressEverywhere,
        "Records that this rank made progress (an elastic trainer's finished step) in every live tdx group of "
        "the process; returns how many groups were marked.");
  m.def("seconds_since_progress", &tdx::shm::secondsSinceProgress,
        "Seconds since this process last made progress in a tdx group (inf before any).");
  m.def("install_fatal_signal_handlers", &tdx::shm::installFatalSignalHandlers,
        "Announces fatal signals (SIGTERM, SIGSEGV, ...) with a default disposition to the peers before dying.");
  m.def("fr_enabled", &tdx::trace::enabled,
        "Whether tdx records its calls in its flight recorder (TORCH_FR_BUFFER_SIZE set above 0).");
  m.def(
      "fr_dump",
      [](bool includeCollectives, bool includeStackTraces, bool onlyActive) {
        return py::bytes(tdx::trace::dump(includeCollectives, includeStackTraces, onlyActive));
      },
      py::arg("include_collectives"), py::arg("include_stack_traces"), py::arg("only_active"),
      "tdx's flight recorder, pickled in the layout of torch's _dump_fr_trace.");
  m.def("fr_write", &tdx::trace::write, py::arg("global_rank"),
        "Writes tdx's flight recorder through torch's DebugInfoWriter (TORCH_FR_DUMP_TEMP_FILE<rank>); returns "
        "the path.");
  tdx::bindReducer(m);
  tdx::bindSharding(m);
  tdx::bindKernels(m);
  tdx::bindTensorParallel(m);
  tdx::bindTuning(m);
}
