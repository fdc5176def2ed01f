// Bindings for the DDP reducer (no logic).
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/extension.h>

#include "reducer/reducer.h"

namespace py = pybind11;

namespace tdx {

void bindReducer(py::module& m) {
  py::class_<Reducer, std::shared_ptr<Reducer>>(m, "Reducer")
      .def(py::init([](std::vector<at::Tensor> params, std::vector<std::string> names,
                       const c10::intrusive_ptr<c10d::ProcessGroup>& pg, size_t firstBucketBytes, size_t bucketBytes,
                       bool findUnused, bool gradAsView) {
             ReducerOptions o;
             o.firstBucketBytes = firstBucketBytes;
             o.bucketBytes = bucketBytes;
             o.findUnusedParameters = findUnused;
             o.gradientAsBucketView = gradAsView;
             return std::make_shared<Reducer>(std::move(params), std::move(names), pg, o);
           }),
           py::arg("params"), py::arg("names"), py::arg("process_group"), py::arg("first_bucket_bytes"),
           py::arg("bucket_bytes"), py::arg("find_unused_parameters"), py::arg("gradient_as_bucket_view"))
      .def("prepare_for_backward", &Reducer::prepareForBackward, py::arg("outputs"),
           py::call_guard<py::gil_scoped_release>())
      .def("bucket_indices", &Reducer::bucketIndices)
      .def_property_readonly("rebuilt", &Reducer::rebuilt);
}

}  // namespace tdx
