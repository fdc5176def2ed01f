"""The columns of the collectives benchmark: one object per way of running a collective.

Every column offers the same five calls on CPU tensors (all_reduce(t) in place, all_gather(out, inp),
reduce_scatter(out, inp), broadcast(t) from rank 0, all_to_all(out, inp)); a call a column lacks raises
NotImplementedError and the table shows "n/a". Optional columns (mpi, deepspeed, noop) are dropped
with a note when their package is missing: they are benchmark extras, never requirements.

  tdx         torch.distributed calls on a "tdx" process group
  tdx-direct  torch.ops.tdx.all_reduce_ / all_gather_into_tensor_ / reduce_scatter_tensor_ on the same group
              (torch's dispatcher only, no torch.distributed Python layer)
  gloo        torch.distributed calls on a "gloo" process group
  mpi         mpi4py on MPI.COMM_WORLD (Open MPI's shared-memory path; needs the run under mpirun,
              which the benchmark starts itself when this column is asked for)
  deepspeed   torch.ops.deepspeed.inference_all_reduce_ (DeepSpeed's CPU shared-memory all_reduce,
              all_reduce SUM of float32 / bfloat16 / float16 only; JIT-built on first use)
  noop        torch.distributed calls on a C++ backend that does nothing (JIT-built on first use):
              torch's own cost per call, the floor under any backend's dist.* figure
  copy        no communication: each rank copies the op's whole array (Tensor.copy_ into a second
              buffer), timed in turn with the other columns, so the copy% column compares an op with
              a plain copy measured in the same machine state
"""
import importlib.util
import os
import shutil

import torch
import torch.distributed as dist

__all__ = ["COLUMNS", "available", "make_column"]

COLUMNS = ("tdx", "tdx-direct", "gloo", "mpi", "deepspeed", "noop", "copy")
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def available(name):
    """"" when column `name` can run here, else why not (a note for the table)."""
    if name == "mpi":
        if importlib.util.find_spec("mpi4py") is None:
            return "mpi4py is not installed (pip install mpi4py, with an MPI such as Debian's openmpi-bin)"
        if shutil.which("mpirun") is None:
            return "mpirun is not on PATH (apt-get install openmpi-bin)"
    if name == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (pip install deepspeed)"
    if name == "noop" and shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler to build the no-op backend"
    return ""


class _Dist:
    """torch.distributed on one process group."""

    def __init__(self, group):
        self.group = group

    def all_reduce(self, t):
        dist.all_reduce(t, group=self.group)

    def all_gather(self, out, inp):
        _all_gather(out, inp, group=self.group)

    def reduce_scatter(self, out, inp):
        _reduce_scatter(out, inp, group=self.group)

    def broadcast(self, t):
        dist.broadcast(t, src=0, group=self.group)

    def all_to_all(self, out, inp):
        dist.all_to_all_single(out, inp, group=self.group)


class _Direct(_Dist):
    """torch.ops.tdx.* on the tdx group (the OpOverload, as a caller holding it would call it)."""

    def __init__(self, group):
        super().__init__(group)
        self.name = group.group_name
        self._ar = torch.ops.tdx.all_reduce_.default
        self._ag = torch.ops.tdx.all_gather_into_tensor_.default
        self._rs = torch.ops.tdx.reduce_scatter_tensor_.default

    def all_reduce(self, t):
        self._ar(t, "sum", self.name)

    def all_gather(self, out, inp):
        self._ag(out, inp, self.name)

    def reduce_scatter(self, out, inp):
        self._rs(out, inp, "sum", self.name)


class _Mpi:
    """mpi4py on COMM_WORLD, on numpy views of the tensors (no copies)."""

    def __init__(self):
        from mpi4py import MPI

        self.MPI, self.comm = MPI, MPI.COMM_WORLD

    @staticmethod
    def _np(t):
        if t.dtype == torch.bfloat16:
            raise NotImplementedError("MPI has no bfloat16")
        return t.numpy()

    def all_reduce(self, t):
        self.comm.Allreduce(self.MPI.IN_PLACE, self._np(t))

    def all_gather(self, out, inp):
        self.comm.Allgather(self._np(inp), self._np(out))

    def reduce_scatter(self, out, inp):
        self.comm.Reduce_scatter_block(self._np(inp), self._np(out))

    def broadcast(self, t):
        self.comm.Bcast(self._np(t), root=0)

    def all_to_all(self, out, inp):
        self.comm.Alltoall(self._np(inp), self._np(out))


class _DeepSpeed:
    """DeepSpeed's shared-memory all_reduce (active when LOCAL_SIZE equals the world size)."""

    def __init__(self, rank, n):
        os.environ["LOCAL_SIZE"] = str(n)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getppid() % 1000))
        from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

        mod = ShareMemCommBuilder().load(verbose=False)
        mod.initialize(n, rank)
        self._ar = torch.ops.deepspeed.inference_all_reduce_.default
        # DeepSpeed never unlinks its segments: once every rank has mapped its peers' (initialize
        # returned everywhere), each removes its own name, so nothing stays in /dev/shm.
        dist.barrier()
        name = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ['MASTER_ADDR']}_"
                f"{os.environ['MASTER_PORT']}_{rank}")
        if os.path.exists(name):
            os.unlink(name)

    def all_reduce(self, t):
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise NotImplementedError("deepspeed reduces float32/bfloat16/float16 only")
        self._ar(t)

    def all_gather(self, out, inp):
        raise NotImplementedError("deepspeed has no shared-memory all_gather")

    reduce_scatter = broadcast = all_to_all = all_gather


_NOOP_SOURCE = r"""
#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

// A Work that is complete when made, and a backend whose every call returns one: what torch costs
// around a backend call, with the backend itself costing (almost) nothing.
class NoopWork : public c10d::Work {
 public:
  bool isCompleted() override { return true; }
  bool wait(std::chrono::milliseconds) override { return true; }
};

class NoopBackend : public c10d::Backend {
 public:
  NoopBackend(int rank, int size) : c10d::Backend(rank, size) {}
  const std::string getBackendName() const override { return "noop"; }
  c10::intrusive_ptr<c10d::Work> done() { return c10::make_intrusive<NoopWork>(); }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>&, const c10d::AllreduceOptions&) override {
    return done();
  }
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>&, const c10d::BroadcastOptions&) override {
    return done();
  }
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor&, at::Tensor&, const c10d::AllgatherOptions&) override {
    return done();
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor&, at::Tensor&,
                                                      const c10d::ReduceScatterOptions&) override {
    return done();
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor&, at::Tensor&, std::vector<int64_t>&,
                                               std::vector<int64_t>&, const c10d::AllToAllOptions&) override {
    return done();
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override { return done(); }
};

c10::intrusive_ptr<c10d::Backend> create(int rank, int size) { return c10::make_intrusive<NoopBackend>(rank, size); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<NoopBackend, c10d::Backend, c10::intrusive_ptr<NoopBackend>>(m, "NoopBackend");
  m.def("create", &create);
}
"""


def register_noop():
    """Builds (once, cached by torch) and registers the no-op backend "noop"; call on every rank."""
    if "noop" in dist.Backend.backend_list:
        return
    from torch.utils.cpp_extension import load_inline

    mod = load_inline("tdx_bench_noop_backend", cpp_sources=[_NOOP_SOURCE], extra_cflags=["-O2"], verbose=False)
    dist.Backend.register_backend("noop", lambda store, rank, size, timeout: mod.create(rank, size), devices=["cpu"])


class _Copy:
    """A plain copy of the op's whole array on every rank (a second buffer, kept per size)."""

    def __init__(self):
        self._dst = None

    def _copy(self, t):
        if self._dst is None or self._dst.numel() != t.numel() or self._dst.dtype != t.dtype:
            self._dst = None  # the old buffer goes first
            self._dst = torch.empty_like(t)
            self._dst.copy_(t)  # fault the pages in
        self._dst.copy_(t)

    def all_reduce(self, t):
        self._copy(t)

    def broadcast(self, t):
        self._copy(t)

    def all_gather(self, out, inp):
        self._copy(out)

    def reduce_scatter(self, out, inp):
        self._copy(inp)

    def all_to_all(self, out, inp):
        self._copy(inp)


def make_column(name, rank, n, groups):
    """The column object for `name`; `groups` maps backend names to their process groups."""
    if name in ("tdx", "gloo", "noop"):
        return _Dist(groups[name])
    if name == "tdx-direct":
        return _Direct(groups["tdx"])
    if name == "mpi":
        return _Mpi()
    if name == "deepspeed":
        return _DeepSpeed(rank, n)
    if name == "copy":
        return _Copy()
    raise ValueError(f"unknown column {name!r}; choose from {', '.join(COLUMNS)}")
