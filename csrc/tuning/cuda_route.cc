#include "tuning/cuda_route.h"

#include <algorithm>
#include <map>
#include <utility>

#include "common/logging.h"

namespace tdx {

const char* toString(CudaRoute route) { return route == CudaRoute::kNccl ? "nccl" : "staged"; }

namespace {

std::string describeSharing(const std::vector<std::vector<int>>& sharing, const std::vector<std::string>& hosts,
                            const std::vector<std::string>& gpus) {
  std::string s;
  for (size_t i = 0; i < sharing.size(); ++i) {
    if (i) s += "; ";
    s += "ranks [";
    for (size_t j = 0; j < sharing[i].size(); ++j) s += (j ? ", " : "") + std::to_string(sharing[i][j]);
    const int r = sharing[i][0];
    s += "] share GPU " + gpus[r] + " on host '" + hosts[r] + "'";
  }
  return s;
}

}  // namespace

CudaRoutePlan planCudaRoute(const std::vector<std::string>& hosts, const std::vector<std::string>& gpus,
                            const std::string& forced) {
  TDX_ENFORCE(hosts.size() == gpus.size(), "CUDA route planning got ", hosts.size(), " hosts for ", gpus.size(),
              " GPU identities");
  TDX_ENFORCE(forced == "auto" || forced == "nccl" || forced == "staged", "TDX_CUDA_PATH is '", forced,
              "'; use auto (the default), nccl or staged");
  CudaRoutePlan plan;
  std::map<std::pair<std::string, std::string>, std::vector<int>> byGpu;
  for (size_t r = 0; r < gpus.size(); ++r) byGpu[{hosts[r], gpus[r]}].push_back(static_cast<int>(r));
  for (auto& [key, ranks] : byGpu) {
    if (ranks.size() > 1) plan.sharing.push_back(ranks);
  }
  // std::map orders by identity; report in rank order.
  std::sort(plan.sharing.begin(), plan.sharing.end());
  const std::string shared = describeSharing(plan.sharing, hosts, gpus);
  if (forced == "nccl") {
    TDX_ENFORCE(plan.sharing.empty(), "TDX_CUDA_PATH=nccl but ", shared,
                ", and NCCL refuses two ranks on one GPU (\"Duplicate GPU detected\"). Give every rank its own GPU "
                "(torch.cuda.set_device(local_rank)) or unset TDX_CUDA_PATH to stage through host memory");
    plan.route = CudaRoute::kNccl;
    plan.reason = "NCCL (forced by TDX_CUDA_PATH=nccl; every rank has its own GPU)";
  } else if (forced == "staged") {
    plan.route = CudaRoute::kStaged;
    plan.reason = "staged through host shared memory (forced by TDX_CUDA_PATH=staged)";
  } else if (!plan.sharing.empty()) {
    plan.route = CudaRoute::kStaged;
    plan.reason = "staged through host shared memory for the whole group, because " + shared +
                  " and NCCL refuses two ranks on one GPU";
  } else {
    plan.route = CudaRoute::kNccl;
    plan.reason = "NCCL (every rank has its own GPU)";
  }
  return plan;
}

}  // namespace tdx
