// Bindings of csrc/kernels (torchdist_ext._C.kernels): no logic.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "backend/kernel_ops.h"

namespace py = pybind11;

namespace tdx {

void bindKernels(py::module& m) {
  auto k = m.def_submodule("kernels", "Compression kernels (CUDA)");
  k.def("built_with_cuda", &builtWithCuda, "Whether this build has the CUDA kernels and the NCCL path.");
  k.def("compress_half", &compressHalf, py::arg("x"), py::arg("bf16"));
  k.def("decompress_half", &decompressHalf, py::arg("x"));
  k.def("int8_quantize", &int8Quantize, py::arg("x"), py::arg("residual") = py::none(), py::arg("block") = 256);
  k.def("int8_dequantize", &int8Dequantize, py::arg("q"), py::arg("scales"), py::arg("block"), py::arg("out"),
        py::arg("accumulate") = false);
}

}  // namespace tdx
