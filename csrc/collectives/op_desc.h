// Operation descriptors: each rank publishes what it is running so peers catch mismatches
// (different collective, dtype, size, root or reduce op) instead of corrupting memory.
#pragma once

#include <string>

#include "collectives/types.h"
#include "transport/shm/shm_group.h"

namespace tdx {

enum class OpCode : uint32_t {
  kAllreduce = 1, kReduce, kBroadcast, kAllgather, kGather, kScatter, kReduceScatter, kAlltoall, kBarrier,
};
const char* opCodeName(OpCode op);

shm::OpDesc makeDesc(const WaitContext& ctx, OpCode op, DataType dt, uint64_t bytes, int root = -1,
                     ReduceOp redop = ReduceOp::kSum, bool hasRedop = false);

// "broadcast(sequence 7, dtype bytes, 64 bytes, root 0)".
std::string describeDesc(const shm::OpDesc& d);

// The history value (see shm::OpDesc::history) after a collective described by `d`.
uint64_t nextHistory(uint64_t history, const shm::OpDesc& d);

// The error text for two ranks that agree on this collective but not on their history.
std::string historyMismatch(const std::string& group, const std::string& me, const shm::OpDesc& mine,
                            const shm::OpDesc& myPrevRooted, const std::string& them, const shm::OpDesc& theirPrevRooted);

// Publishes this rank's descriptor (with its history) in half `h` (before the step that peers wait on).
void publishDesc(shm::ShmGroup& g, int h, const shm::OpDesc& mine);

// Throws on every field (and on a different history: an earlier rooted collective mismatched) of rank r's descriptor in half `h` that differs from `expected`.
// `checkBytes` is false where ranks legitimately pass different sizes. A mismatch marks the group
// failed, so peers that do not wait for this rank in this collective fail at their next wait.
void checkDesc(const shm::ShmGroup& g, int r, int h, const shm::OpDesc& expected, bool checkBytes = true);

// One synchronization where every rank compares every rank's descriptor (a barrier that checks).
void agree(shm::ShmGroup& g, const shm::OpDesc& mine, const WaitContext& ctx, bool checkBytes = true);

// agree() in two parts, so that other work (an operation's cross-host part) runs between them:
// beginAgree publishes this rank's descriptor and posts without waiting; finishAgree waits until
// every rank has posted it and compares. Between the two this rank runs at most one other
// collective of `g` (a second one would reuse the half holding the descriptor).
struct PendingAgree {
  int half = -1;  // -1: nothing pending
  uint32_t filled = 0;
};
PendingAgree beginAgree(shm::ShmGroup& g, const shm::OpDesc& mine, const WaitContext& ctx);
void finishAgree(shm::ShmGroup& g, const PendingAgree& p, const shm::OpDesc& mine, const WaitContext& ctx,
                 bool checkBytes = true);
// Without waiting: compares `mine` with the descriptor of every rank that has already published
// one for this operation (same sequence number) and throws on a difference. For an error path,
// where the operation's own descriptor names the mismatch better than a step inside it.
void recheckAgree(const shm::ShmGroup& g, const PendingAgree& p, const shm::OpDesc& mine, bool checkBytes = true);

// Rooted collectives (broadcast, scatter, gather), first round, after this rank's first post
// returned `filled`: waits until every rank has posted it (has published its descriptor for this
// collective) and compares every rank's descriptor with `mine`, so ranks that disagree on the root
// raise in the call itself on every rank, the root included. The root waits only for the others'
// arrival, after its own copy; non-roots would wait for the root anyway.
void checkRooted(shm::ShmGroup& g, int h, uint32_t filled, const shm::OpDesc& mine, const WaitContext& ctx);

// Under full checks (TDX_DEBUG=1, TORCH_DISTRIBUTED_DEBUG=DETAIL): one extra synchronization
// right after the first publishDesc, then every rank compares every rank's descriptor, so a
// mismatch raises on every rank in the same collective, including the rooted ones where only
// some ranks wait for others. A no-op otherwise.
void fullCheck(shm::ShmGroup& g, int h, const shm::OpDesc& mine, const WaitContext& ctx, bool checkBytes = true);

// Acquires the next buffer half for a round of a collective; on its first round, publishes and
// (under full checks) compares the descriptor. Returns the half.
int acquireRound(shm::ShmGroup& g, bool first, const shm::OpDesc& mine, const WaitContext& ctx,
                 bool checkBytes = true);

}  // namespace tdx
