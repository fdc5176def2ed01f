// Which path CUDA tensors take, decided from every rank's GPU identity. No torch or CUDA types:
// the backend exchanges the identities through the c10d store and calls planCudaRoute.
//
// NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"), so when any
// two ranks share a GPU the whole group stages CUDA tensors through host memory and the
// shared-memory collectives instead (all ranks must take the same path: they run the same
// collective together).
#pragma once

#include <string>
#include <vector>

namespace tdx {

enum class CudaRoute { kNccl, kStaged };

struct CudaRoutePlan {
  CudaRoute route = CudaRoute::kNccl;
  // Groups of ranks that share one GPU (only groups of 2 or more), in rank order.
  std::vector<std::vector<int>> sharing;
  // One sentence for logs and errors: which path and why.
  std::string reason;
};

// hosts[r] and gpus[r]: rank r's host and its GPU's identity (UUID or PCI bus id) on that host.
// `forced` is TDX_CUDA_PATH: "auto", "nccl" or "staged". Throws tdx::Error when the request
// cannot work (nccl forced while ranks share a GPU, an unknown value, mismatched lengths).
CudaRoutePlan planCudaRoute(const std::vector<std::string>& hosts, const std::vector<std::string>& gpus,
                            const std::string& forced);

const char* toString(CudaRoute route);

}  // namespace tdx
