// Bindings for the tensor-parallel communication operators (csrc/tensor_parallel/comm_ops.h).
#include <torch/extension.h>

#include "tensor_parallel/comm_ops.h"

namespace py = pybind11;

namespace tdx {

void bindTensorParallel(py::module& m) {
  auto tp = m.def_submodule("tp", "tensor-parallel communication operators (autograd functions)");
  const auto release = py::call_guard<py::gil_scoped_release>();
  tp.def("copy_to_region", &tp::copyToRegion, py::arg("x"), py::arg("group"), release);
  tp.def("reduce_from_region", &tp::reduceFromRegion, py::arg("x"), py::arg("group"), release);
  tp.def("gather_dim", &tp::gatherDim, py::arg("x"), py::arg("group"), py::arg("dim"), py::arg("reduce_grad"), release);
  tp.def("scatter_dim", &tp::scatterDim, py::arg("x"), py::arg("group"), py::arg("dim"), release);
  tp.def("reduce_scatter_dim", &tp::reduceScatterDim, py::arg("x"), py::arg("group"), py::arg("dim"), release);
  tp.def("bytes_communicated", &tp::bytesCommunicated);
  tp.def("reset_bytes_communicated", &tp::resetBytesCommunicated);
}

}  // namespace tdx
