// Bindings for the sharding core (no logic).
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "common/logging.h"
#include "sharding/flat_layout.h"
#include "sharding/flat_views.h"
#include "sharding/shard_math.h"

namespace py = pybind11;

namespace tdx {

void bindSharding(py::module& m) {
  py::class_<FlatLayout>(m, "FlatLayout")
      .def(py::init([](std::vector<int64_t> numels, int64_t alignment, int64_t worldSize) {
             return makeFlatLayout(numels, FlatLayoutOptions{alignment, worldSize});
           }),
           py::arg("numels"), py::arg("alignment"), py::arg("world_size"))
      .def_readonly("numels", &FlatLayout::numels)
      .def_readonly("offsets", &FlatLayout::offsets)
      .def_readonly("unpadded_numel", &FlatLayout::unpaddedNumel)
      .def_readonly("padded_numel", &FlatLayout::paddedNumel)
      .def_readonly("shard_numel", &FlatLayout::shardNumel)
      .def_readonly("alignment", &FlatLayout::alignment)
      .def_readonly("world_size", &FlatLayout::worldSize)
      .def("split_sizes", &splitSizes)
      .def("shard_range",
           [](const FlatLayout& l, int64_t rank) {
             ShardRange r = shardRange(l, rank);
             return std::make_pair(r.begin, r.end);
           },
           py::arg("rank"), "(begin, end) of the flat elements `rank` owns")
      .def("pieces_in_shard",
           [](const FlatLayout& l, int64_t rank) {
             std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> out;
             for (const ShardPiece& p : piecesInShard(l, rank))
               out.emplace_back(p.param, p.paramBegin, p.paramEnd, p.shardOffset);
             return out;
           },
           py::arg("rank"), "[(param, param_begin, param_end, shard_offset)] inside `rank`'s shard")
      .def("reshard_pieces",
           [](const FlatLayout& src, const FlatLayout& dst, int64_t dstRank) {
             std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> out;
             for (const ReshardPiece& p : reshardPieces(src, dst, dstRank))
               out.emplace_back(p.srcRank, p.srcOffset, p.length, p.dstOffset);
             return out;
           },
           py::arg("dst"), py::arg("dst_rank"),
           "[(src_rank, src_offset, length, dst_offset)] filling dst_rank's shard of `dst` from this layout's shards")
      .def("flatten",
           [](const FlatLayout& l, const std::vector<at::Tensor>& params, at::ScalarType dtype, const at::Device& device) {
             return flattenParams(params, l, at::TensorOptions().dtype(dtype).device(device));
           },
           py::arg("params"), py::arg("dtype"), py::arg("device"),
           "a new padded flat tensor holding `params` at their offsets")
      .def("views",
           [](const FlatLayout& l, const at::Tensor& flat, const std::vector<std::vector<int64_t>>& shapes) {
             return paramViews(flat, l, shapes);
           },
           py::arg("flat"), py::arg("shapes"),
           "parameter views into `flat` (one split_with_sizes, autograd-aware)")
      .def("__repr__", [](const FlatLayout& l) {
        return str("FlatLayout(params=", l.numels.size(), ", unpadded=", l.unpaddedNumel, ", padded=", l.paddedNumel,
                   ", shard=", l.shardNumel, ", world_size=", l.worldSize, ")");
      });
}

}  // namespace tdx
