// Environment knobs. Every knob has the TDX_ prefix and is read once, here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace tdx {

struct EnvKnobs {
  // TDX_BUFFER_BYTES: bytes of each half of a rank's collective buffer (two halves, double-buffered).
  size_t bufferBytes = 512u << 10;
  // TDX_ONESHOT_BYTES: all_reduce/reduce messages up to this size use the one-shot algorithm.
  // Unset (SIZE_MAX): 256 KiB / ranks^2, between 4 and 128 KiB (64 KiB at 2 ranks, 16 KiB at 4,
  // 4 KiB at 8; tuning::oneshotLimit says why); 4 KiB for fp16/bf16; 0: never.
  size_t oneshotBytes = SIZE_MAX;
  // TDX_SINGLE_COPY_BYTES: an all_gather whose output has from this many bytes up to 4 MiB reads
  // the peers' inputs straight into its output (process_vm_readv, one copy) instead of through
  // shared memory (two); 0 turns it off. Unset (SIZE_MAX): 64 KiB on AMD CPUs, 16 KiB elsewhere,
  // off in groups of more than 4 ranks (tuning/plan.cc says why).
  size_t singleCopyBytes = SIZE_MAX;
  // TDX_P2P_RING_BYTES: bytes of each per-peer send ring.
  size_t p2pRingBytes = 1u << 20;
  // TDX_SPIN_US: microseconds a wait spins before it starts yielding the core.
  // -1 (unset): 50, or 5 when the group's ranks outnumber this process's cores.
  int spinUs = -1;
  // TDX_YIELD_US: microseconds (from the start of a wait) of polling with sched_yield before it
  // sleeps on a futex. -1 (unset): 2000, or 100 when ranks outnumber cores (polling would then
  // take the core from a rank that has work to do).
  int yieldUs = -1;
  // TDX_DEBUG: 1 (or TORCH_DISTRIBUTED_DEBUG=DETAIL) adds full collective-descriptor checks: one
  // extra synchronization per collective where every rank compares every rank's descriptor.
  bool debug = false;
  // TDX_CUDA_PATH: how CUDA tensors move. "auto" (unset): NCCL when every rank has its own GPU,
  // staging through host shared memory when two ranks share one; "nccl" or "staged" force one.
  std::string cudaPath = "auto";
  // TDX_XHOST_CHUNK_BYTES: across hosts, collectives move their data in about 8 chunks, so the
  // shared-memory phases of one chunk overlap the network transfer of others; chunks are never
  // smaller than this many bytes (each costs a Gloo operation and a synchronization). 0 (unset):
  // 2 MiB on a link measured fast at group creation, where those costs dominate, else 512 KiB.
  size_t xhostChunkBytes = 0;
  // TDX_XHOST_COMPRESS: "bf16" or "fp16" sends float32 all_reduce / reduce data between hosts at
  // half width, "int8" as blockwise int8 with a float32 scale per block (reduced in full precision
  // inside each host); "none" (unset) sends it as it is.
  std::string xhostCompress = "none";
  // TDX_XHOST_ALGO: how a collective crosses hosts. "sliced": each local rank carries a slice
  // through its own Gloo group (every byte crosses a host link once); "flat": one Gloo operation
  // over all ranks (Gloo's own algorithm); "auto" (unset): chosen per call from the operation, its
  // bytes and the link rate measured when the group is made.
  std::string xhostAlgo = "auto";
  // TDX_FAILURE_DETECTION_S: the one failure-detection time, in seconds (> 0). The waits of the
  // cross-host failure path derive from it (failure_waits.h); the Python side derives the
  // liveness lease and the stuck time from the same variable.
  double failureDetectionS = 5.0;
};

// Reads the knobs from the environment on first call; later calls return the same values.
const EnvKnobs& env();

// Knobs read at each call (a process may change them between process groups or models):
// TDX_DDP_DIRECT: false when set to "0" (our DDP then reduces through flat bucket copies on tdx too).
bool ddpDirect();

// Parses a number of seconds > 0 such as "5" or "0.5"; throws tdx::Error naming `name` otherwise.
double parseSeconds(const char* name, const char* text);

// Parses a size such as "4096", "64K", "8M" or "1G"; throws tdx::Error naming `name` otherwise.
size_t parseSize(const char* name, const char* text);

// TDX_REDUCE_ISA=generic: the reductions use the portable loops even where the CPU has AVX2 + F16C;
// =avx2: not the AVX-512 bf16 folds (reduce_kernels_avx512.cc) where the CPU has AVX-512.
// Read on each call without the knob cache, so it is safe in static initializers.
bool reduceIsaGeneric();
// TDX_REDUCE_ISA is generic or avx2 (read like reduceIsaGeneric).
bool reduceIsaWithoutAvx512();

// TDX_SHM_STREAM: how all_reduce, all_gather, reduce_scatter, broadcast, all_to_all and scatter copy
// into shared memory (collectives/stream_copy.h). 1: streaming stores; 0: ordinary stores; -1 (unset
// or "auto"): chosen per call from the times of recent calls of the same op and size (PeerCopy).
// Read without the knob cache, so it is safe in static initializers.
int shmStreamStores();

// Whether this is an AMD CPU. TDX_SINGLE_COPY_BYTES's default follows from it:
// AMD's last-level cache is split between core complexes, which a VM's guest cannot see.
bool cpuIsAmd();

// TDX_PHASE_TIMES=1 (a diagnosis aid): all_reduce's reduce-scatter + all-gather rounds add up the
// time of each phase (copy in, waits, fold, gather) and print the totals per process to stderr at
// exit. Read without the knob cache, so it is safe in static initializers.
bool phaseTimes();

}  // namespace tdx
