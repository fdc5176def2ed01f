// Bindings of the decision room (csrc/tuning/plan.h): `python -m torchdist_ext.bench plan` prints
// what the planner chooses for a group.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <algorithm>

#include "common/env.h"
#include "tuning/knobs.h"
#include "tuning/pipeline.h"
#include "tuning/plan.h"

namespace py = pybind11;

namespace tdx {

void bindTuning(py::module& m) {
  auto t = m.def_submodule("tuning", "the decision room: which algorithm a call takes (csrc/tuning/plan.h)");
  t.def("batch_weight_grads", &tuning::batchWeightGrads, py::arg("in_features"), py::arg("out_features"),
        "Whether a pipeline stage's Linear(in_features, out_features) batches its weight gradients by default "
        "(PipelineStage(batch_weight_grads=None)).");
  t.def("amd_cpu", &cpuIsAmd, "Whether this is an AMD CPU (the single-copy all_gather's default follows from it).");
  t.def(
      "knobs",
      [] {
        const tuning::Knobs k = tuning::knobsFromEnv();
        py::dict d;
        d["xhost_algo"] = k.xhostAlgo;
        d["xhost_compress"] = k.xhostCompress;
        d["xhost_chunk_bytes"] = k.xhostChunkBytes;
        d["oneshot_bytes"] = k.oneshotBytes == SIZE_MAX ? py::object(py::none()) : py::int_(k.oneshotBytes);
        d["single_copy_bytes"] = k.singleCopyBytes == SIZE_MAX ? py::object(py::none()) : py::int_(k.singleCopyBytes);
        d["shm_stream"] = k.shmStream;
        d["shm_half_bytes"] = k.shmHalfBytes;
        return d;
      },
      "The planner's knobs as this process's environment sets them (None: the planner's default).");
  t.def(
      "plan",
      [](const std::string& op, uint64_t bytes, const std::string& dtype, const std::string& redop, int ranks,
         int hosts, int localSize, bool uniform, double linkBytesPerSec, bool amdCpu, bool equalBlocks) {
        tuning::Call c;
        c.op = tuning::parseOp(op);
        c.bytes = bytes;
        c.dtype = tuning::parseDtype(dtype);
        c.redop = tuning::parseRedop(redop);
        c.equalBlocks = equalBlocks;
        tuning::Group g;
        g.ranks = ranks;
        g.hosts = hosts;
        g.localSize = localSize > 0 ? localSize : ranks / std::max(hosts, 1);  // -1: as many on every host
        g.uniform = uniform;
        g.linkBytesPerSec = linkBytesPerSec;
        g.amdCpu = amdCpu;
        const tuning::Plan p = tuning::plan(c, g, tuning::knobsFromEnv());
        py::dict d;
        d["route"] = tuning::routeName(p.route);
        d["host"] = tuning::hostAlgoName(p.host);
        d["link"] = tuning::linkAlgoName(p.link);
        d["stores"] = tuning::storesName(p.stores);
        d["compress"] = p.compress;
        d["reduce_as_allreduce"] = p.reduceAsAllreduce;
        d["chunk_bytes"] = p.chunkBytes;
        d["direct_gather"] = p.directGather;
        d["text"] = p.describe();
        return d;
      },
      py::arg("op"), py::arg("bytes"), py::arg("dtype") = "float32", py::arg("redop") = "sum", py::arg("ranks"),
      py::arg("hosts") = 1, py::arg("local_size") = -1, py::arg("uniform") = true, py::arg("link_bytes_per_sec") = 0.0,
      py::arg("amd_cpu") = false, py::arg("equal_blocks") = true,
      "What a call takes in a group of this shape (tuning::plan, with this process's knobs): a dict of route, "
      "host, link, stores, compress, reduce_as_allreduce, chunk_bytes, direct_gather and text.");
}

}  // namespace tdx
