// Bindings for the DDP reducer (no logic).
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/extension.h>

#include "python/python_comm_hook.h"
#include "reducer/builtin_hooks.h"
#include "reducer/reducer.h"

namespace py = pybind11;

namespace tdx {

void bindReducer(py::module& m) {
  py::class_<Reducer, std::shared_ptr<Reducer>>(m, "Reducer")
      .def(py::init([](std::vector<at::Tensor> params, std::vector<std::string> names,
                       const c10::intrusive_ptr<c10d::ProcessGroup>& pg, size_t firstBucketBytes, size_t bucketBytes,
                       bool findUnused, bool gradAsView, bool staticGraph) {
             ReducerOptions o;
             o.firstBucketBytes = firstBucketBytes;
             o.bucketBytes = bucketBytes;
             o.findUnusedParameters = findUnused;
             o.gradientAsBucketView = gradAsView;
             o.staticGraph = staticGraph;
             return std::make_shared<Reducer>(std::move(params), std::move(names), pg, o);
           }),
           py::arg("params"), py::arg("names"), py::arg("process_group"), py::arg("first_bucket_bytes"),
           py::arg("bucket_bytes"), py::arg("find_unused_parameters"), py::arg("gradient_as_bucket_view"), py::arg("static_graph") = false)
      .def("prepare_for_backward", &Reducer::prepareForBackward, py::arg("outputs"),
           py::call_guard<py::gil_scoped_release>())
      .def("bucket_indices", &Reducer::bucketIndices)
      .def("remove_hooks", &Reducer::removeHooks, "Removes the gradient hooks (the Reducer then reduces nothing).")
      .def("direct_buckets", &Reducer::directBuckets)
      .def("bucket_bytes_allocated", &Reducer::bucketBytesAllocated)
      .def("rebuild_buckets", &Reducer::rebuildBucketsIfDue, py::call_guard<py::gil_scoped_release>())
      .def("set_divide_factor", &Reducer::setDivideFactor, py::arg("factor"))
      .def_property_readonly("rebuilt", &Reducer::rebuilt)
      .def_property_readonly("iterations", &Reducer::iterations)
      .def_property_readonly("comm_hook_name", &Reducer::commHookName)
      .def("register_comm_hook",
           [](Reducer& r, py::object state, py::object hook) {
             r.registerCommHook(makePythonCommHook(std::move(state), std::move(hook)));
           },
           py::arg("state"), py::arg("hook"))
      .def("register_builtin_comm_hook",
           [](Reducer& r, const c10::intrusive_ptr<c10d::ProcessGroup>& pg, const std::string& kind,
              int64_t int8Block, double topkRatio) {
             BuiltinHookOptions o;
             o.kind = kind;
             o.int8Block = int8Block;
             o.topkRatio = topkRatio;
             r.registerCommHook(makeBuiltinHook(pg, o));
           },
           py::arg("process_group"), py::arg("kind"), py::arg("int8_block") = 256, py::arg("topk_ratio") = 0.01)
      .def("queue_finalize", &Reducer::queueFinalize, py::call_guard<py::gil_scoped_release>())
      .def("join_shadow_backward", &Reducer::joinShadowBackward, py::call_guard<py::gil_scoped_release>());
}

}  // namespace tdx
