#include "cuda/nccl_comm.h"

#include <cstring>

#include "common/logging.h"

namespace tdx {
namespace nccl {

void check(ncclResult_t r, const char* call, ncclComm_t comm) {
  if (r == ncclSuccess) return;
  std::string detail = ncclGetErrorString(r);
  if (const char* last = ncclGetLastError(comm); last && *last) detail += str(" (", last, ")");
  throw Error(str("tdx: NCCL call ", call, " failed: ", detail));
}

void checkCuda(cudaError_t e, const char* call) {
  if (e == cudaSuccess) return;
  throw Error(str("tdx: CUDA call ", call, " failed: ", cudaGetErrorString(e)));
}

NcclComm::NcclComm(Rendezvous& rdv, const std::string& key, int rank, int size, int device) : device_(device) {
  ncclUniqueId id;
  if (rank == 0) {
    check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    rdv.set(key, std::string(reinterpret_cast<const char*>(&id), sizeof(id)));
  } else {
    const std::string v = rdv.get(key);
    TDX_ENFORCE(v.size() == sizeof(id), "the NCCL id under store key '", key, "' has ", v.size(), " bytes, expected ",
                sizeof(id), "; another program may use the same store keys");
    std::memcpy(&id, v.data(), sizeof(id));
  }
  int prev = 0;
  checkCuda(cudaGetDevice(&prev), "cudaGetDevice");
  checkCuda(cudaSetDevice(device), "cudaSetDevice");
  const ncclResult_t r = ncclCommInitRank(&comm_, size, id, rank);
  cudaSetDevice(prev);
  check(r, "ncclCommInitRank");
}

NcclComm::~NcclComm() {
  std::lock_guard<std::mutex> lock(mu_);
  if (comm_ && !aborted_.load()) ncclCommDestroy(comm_);
}

std::string NcclComm::asyncError() {
  if (aborted_.load()) return "the NCCL communicator was aborted";
  ncclResult_t async = ncclSuccess;
  const ncclResult_t r = ncclCommGetAsyncError(comm_, &async);
  if (r != ncclSuccess) return str("ncclCommGetAsyncError failed: ", ncclGetErrorString(r));
  if (async == ncclSuccess || async == ncclInProgress) return "";
  std::string detail = ncclGetErrorString(async);
  if (const char* last = ncclGetLastError(comm_); last && *last) detail += str(" (", last, ")");
  return str("NCCL reported an asynchronous error: ", detail);
}

void NcclComm::abort() {
  std::lock_guard<std::mutex> lock(mu_);
  if (aborted_.exchange(true) || !comm_) return;
  ncclCommAbort(comm_);
}

ncclDataType_t toNcclType(DataType dt) {
  switch (dt) {
    case DataType::kFloat32: return ncclFloat32;
    case DataType::kFloat64: return ncclFloat64;
    case DataType::kFloat16: return ncclFloat16;
    case DataType::kBFloat16: return ncclBfloat16;
    case DataType::kInt8: return ncclInt8;
    case DataType::kInt32: return ncclInt32;
    case DataType::kInt64: return ncclInt64;
    case DataType::kUInt8: return ncclUint8;
    default: return ncclUint8;  // int16, bool, bytes: moved as bytes, never reduced (supportsReduce)
  }
}

bool supportsReduce(DataType dt, ReduceOp op) {
  switch (dt) {
    case DataType::kInt16:
    case DataType::kBool:
    case DataType::kBytes:
      return false;
    default:
      break;
  }
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kProduct:
    case ReduceOp::kMin:
    case ReduceOp::kMax:
      return true;
    case ReduceOp::kAvg:  // ncclAvg is defined for floating types only
      return dt == DataType::kFloat32 || dt == DataType::kFloat64 || dt == DataType::kFloat16 ||
             dt == DataType::kBFloat16;
    default:
      return false;  // bitwise ops
  }
}

ncclRedOp_t toNcclOp(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kProduct: return ncclProd;
    case ReduceOp::kMin: return ncclMin;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kAvg: return ncclAvg;
    default: throw Error("tdx: internal: NCCL has no bitwise reduce op; the caller must stage it");
  }
}

}  // namespace nccl
}  // namespace tdx

