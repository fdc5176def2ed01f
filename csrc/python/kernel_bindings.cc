// Bindings of csrc/kernels (torchdist_ext._C.kernels): no logic.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "backend/kernel_ops.h"

namespace py = pybind11;

namespace tdx {

void bindKernels(py::module& m) {
  auto k = m.def_submodule("kernels", "Fused pack/unpack and compression kernels (CPU loops and CUDA)");
  k.def("built_with_cuda", &builtWithCuda, "Whether this build has the CUDA kernels and the NCCL path.");
  k.def("flat_layout", &flatLayout, py::arg("numels"), py::arg("align") = 1, py::arg("divisor") = 1);
  k.def("pack", &packTensors, py::arg("tensors"), py::arg("flat"), py::arg("offsets"), py::arg("scale") = 1.0,
        py::call_guard<py::gil_scoped_release>());
  k.def("unpack", &unpackTensors, py::arg("flat"), py::arg("tensors"), py::arg("offsets"),
        py::call_guard<py::gil_scoped_release>());
  k.def("compress_half", &compressHalf, py::arg("x"), py::arg("bf16"));
  k.def("decompress_half", &decompressHalf, py::arg("x"));
  k.def("int8_quantize", &int8Quantize, py::arg("x"), py::arg("residual") = py::none(), py::arg("block") = 256);
  k.def("int8_dequantize", &int8Dequantize, py::arg("q"), py::arg("scales"), py::arg("block"), py::arg("out"),
        py::arg("accumulate") = false);
}

}  // namespace tdx
