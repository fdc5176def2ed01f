#include "python/python_comm_hook.h"

#include <pybind11/stl.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

namespace py = pybind11;

namespace tdx {
namespace {

// Runs `f` (which calls Python); a Python exception becomes an error naming the hook and `what`.
template <typename F>
auto callPython(const std::string& name, const char* what, F&& f) -> decltype(f()) {
  std::string err;
  try {
    return f();
  } catch (py::error_already_set& e) {
    err = e.what();
  }
  TORCH_CHECK(false, "DDP comm hook ", name, " ", what, ": ", err);
}

// Holds the Python future; wait() calls its wait() and takes the tensor (or a list's first).
class PythonPending : public PendingBucket {
 public:
  PythonPending(py::object fut, std::string name) : fut_(std::move(fut)), name_(std::move(name)) {}
  ~PythonPending() override {
    py::gil_scoped_acquire gil;
    fut_ = py::object();
  }
  at::Tensor wait() override {
    py::gil_scoped_acquire gil;
    return callPython(name_, "failed while waiting on its future", [&]() -> at::Tensor {
      py::object v = fut_.attr("wait")();
      if (py::isinstance<py::list>(v) || py::isinstance<py::tuple>(v)) {
        py::sequence seq = v;
        TORCH_CHECK(py::len(seq) >= 1, "DDP comm hook ", name_, ": its future's value is an empty list");
        v = seq[0];
      }
      TORCH_CHECK(THPVariable_Check(v.ptr()), "DDP comm hook ", name_,
                  ": its future must hold a tensor (the reduced bucket), got ", std::string(py::str(py::type::of(v).attr("__name__"))));
      return THPVariable_Unpack(v.ptr());
    });
  }

 private:
  py::object fut_;
  std::string name_;
};

class PythonCommHook : public CommHook {
 public:
  PythonCommHook(py::object state, py::object hook) : state_(std::move(state)), hook_(std::move(hook)) {
    name_ = py::hasattr(hook_, "__qualname__") ? std::string(py::str(hook_.attr("__qualname__")))
                                                : std::string(py::str(hook_));
  }
  ~PythonCommHook() override {
    py::gil_scoped_acquire gil;
    state_ = py::object();
    hook_ = py::object();
  }
  std::string name() const override { return name_; }

  std::unique_ptr<PendingBucket> run(c10d::GradBucket& bucket) override {
    py::gil_scoped_acquire gil;
    return callPython(name_, "raised", [&]() -> std::unique_ptr<PendingBucket> {
      py::object fut = hook_(state_, std::make_shared<c10d::GradBucket>(bucket));
      TORCH_CHECK(py::hasattr(fut, "wait"), "DDP comm hook ", name_,
                  " must return a torch.futures.Future (e.g. dist.all_reduce(..., async_op=True).get_future()), "
                  "got ", std::string(py::str(py::type::of(fut).attr("__name__"))));
      return std::make_unique<PythonPending>(std::move(fut), name_);
    });
  }

 private:
  py::object state_;
  py::object hook_;
  std::string name_;
};

}  // namespace

std::shared_ptr<CommHook> makePythonCommHook(py::object state, py::object hook) {
  return std::make_shared<PythonCommHook>(std::move(state), std::move(hook));
}

}  // namespace tdx
