// Every algorithm choice of tdx and the measurements behind each threshold (see plan.h).
#include "tuning/plan.h"

#include <algorithm>
#include <cstdio>

namespace tdx::tuning {

namespace {

// ---- Shared memory.

// The single-copy all_gather's output sizes: from the group's threshold up to this. Larger ones
// take the rounds: the kernel pins and maps every page it copies, and the staging through
// cache-sized halves cost less there. 2-core AMD VM, 2 ranks, three alternating runs each: 8 MB of
// output 532-544 us through shared memory against 718-761 read directly, 16 MB 1933-2063 against
// 2582-2958, 32 MB 4212-4459 against 6118-6950; 512 KB-4 MB within 3% either way
// (docs/bench/cpu-2rank-2core-allgather-single-copy.txt; from 64 MB see docs/bench/large-allreduce.txt).
constexpr uint64_t kSingleCopyMaxBytes = 4u << 20;
// Single copy is offered by default from 64 KiB on AMD CPUs (2-core AMD VM, 2 ranks, three
// alternating runs of each: 128 KB 10.5-10.8 us vs 12.7-14.9 through shared memory, 256 KB
// 16.9-17.4 vs 23.4-25.8, 512 KB 31.8-32.1 vs 41.6-46.8, 64 KB even at 7.6, 32 KB 6.2 vs 4.7;
// docs/performance.md, "Large messages"), from 16 KiB elsewhere: on the Intel VM the direct read
// won from 16 KiB (2 ranks, 256 KB 9.7-10.0 us vs 17.6-18.7, 32 KB 4.1-4.2 vs 5.3-5.4; 8 KB 3.5-3.6
// vs 3.1-3.3). Not in groups of more than kSingleCopyMaxRanks, where every rank's memory is read by
// 7 or more peers at once: at 8 ranks on the 16-core device the shared-memory route took 256 KB
// 35-41 us vs 87-90, 1 MB 201-275 vs 339-346, 16 MB 3191-3725 vs 5419-5524 (alternating runs,
// docs/performance.md "4 and 8 ranks"); at 4 ranks the direct read beat MPI's all_gather
// 1.14x-1.75x from 16 KB to 16 MB.
constexpr int kSingleCopyMaxRanks = 4;
constexpr size_t kSingleCopyAmdMin = 64u << 10;
constexpr size_t kSingleCopyMin = 16u << 10;

// ---- Which stores (storesSwitch, storesCost; collectives/stream_copy.cc measures).
// Neither kind of store is the faster one everywhere, nor on one machine all the time. A store to a
// line a peer read must first take the line from that peer's cache. On a 2-core AMD EPYC VM that
// cost switches with the placement of the two vCPUs, which the guest cannot see and which changes
// while it runs: 2-rank all_reduce of 1 MB took 70 us with ordinary stores and 100-155 us with
// streaming ones in some minutes, and 494 us against 140 us in others; at 256 KB the two kinds were
// even. Where cores share one last-level cache (the Intel Xeon VMs measured, 2 and 16 cores)
// ordinary stores were the faster kind. So each call measures (docs/performance.md, "Which stores").
// A switch only when the other kind is cheaper by more than 1/8 (kStoreSwitchEighths of eight), so
// kinds that cost about the same do not take turns (and the ranks of a group, each choosing from its
// own times, disagree less often).
constexpr uint64_t kStoreSwitchEighths = 7;
// A measured call moves its kind's cost a quarter of the way to its own; a call the scheduler
// interrupted counts at most kStoreSampleCap times the smoothed cost. A trial replaces its kind's
// estimate (the other kind's was measured calls ago): a lucky trial makes that kind the choice,
// and the calls that follow correct it.
constexpr uint64_t kStoreSampleCap = 4;

// ---- Waiting in shared memory (shmWait).
// A wait spins kSpinUs (a peer on another core answers within microseconds), then yields until
// kYieldUs. When this host's ranks outnumber its cores, or the group spans hosts (a host mate is
// waited for while it waits on the network: polling would only take the core from the threads
// moving the data), it gives the core up sooner.
constexpr int kSpinUs = 50;
constexpr int kYieldUs = 2000;
constexpr int kOversubscribedSpinUs = 5;
constexpr int kOversubscribedYieldUs = 100;

// ---- Across hosts (docs/bench/hosts-2x2-2core.txt holds the A/B runs quoted here).

// Bytes per second per host link direction above which a link is fast (1 Gbit/s: 125e6).
constexpr double kFastLink = 300e6;
// Between two hosts a broadcast always takes the sliced form: the root's relay sends across once
// and each host's ranks get the bytes in shared memory, where the flat form sent them from the
// root to every rank over Gloo (2 x 2, alternating runs, p50 per run: 4-128 KiB 1.09x-1.91x gloo's
// speed sliced against 0.83x-1.36x flat unshaped, 4-80 KiB 1.03x-1.96x against 0.89x-1.65x at
// 1 Gbit/s; back to back 190-324 us per broadcast against 385-450 us, gloo 432-562 us). From
// three hosts the sliced broadcast is a chain of hosts (H - 1 hops), so there a broadcast below
// kFlatBroadcastMax on a slow link, or below kFastBroadcastMax on a fast one, goes from the root to
// every rank (measured before the sliced form's chunks became p2p: from 96 KiB the sliced form was
// 1.3-1.6x quicker at 1 Gbit/s, 2.2-3.0x at 128-192 KiB).
constexpr uint64_t kFlatBroadcastMax = 96u << 10;
constexpr uint64_t kFastBroadcastMax = 256u << 10;
// A reduce below this runs as the sliced all_reduce (a Gloo reduce, flat or in the slices, takes
// longer than the slices' all_reduce there).
constexpr uint64_t kReduceAsAllreduceMax = 256u << 10;
// Between two hosts, an all_reduce (reduce) below this many bytes swaps its slice partials (a
// Gloo all_gather: one message each way where its all_reduce takes two dependent steps) instead
// of running Gloo's all_reduce (reduce) on them; at 1 MB the swap measured a little slower
// (docs/multihost.md, "Measured").
constexpr uint64_t kExchangeMaxBytes = 1u << 20;
// The sliced all_gather's output size from which each host's part goes straight into the outputs
// (unshaped, 2 x 2: 16 MB 0.93x gloo's speed through the buffer, 1.25x-1.28x straight; 4 MB 1.08x
// and 1.20x; 1 MB 1.30x and 1.13x, 64 KB 1.45x and 1.17x).
constexpr uint64_t kDirectGatherMin = 4u << 20;
// Chunk floors (chunkFloorBytes): unshaped 4 MB all_reduce 1.26-1.36x gloo with 2 MiB, 0.55-0.57x
// with 256 KiB. Each Gloo operation is also a chance of a stall of milliseconds: at 1 Gbit/s the
// 1 MB all_reduce's p90 was 1.37-1.58x Gloo's with 512 KiB chunks (one per slice) against
// 1.05-1.41x with 256 KiB, medians and 4 MB alike.
constexpr uint64_t kFastChunkBytes = 2u << 20;
constexpr uint64_t kSlowChunkBytes = 512u << 10;

// Gloo's reduce_scatter takes these dtypes and ops (AVG as SUM, then divided).
bool glooReduceScatters(DataType dtype, ReduceOp op) {
  const bool type = dtype == DataType::kFloat32 || dtype == DataType::kFloat64 || dtype == DataType::kInt32 ||
                    dtype == DataType::kInt64;
  return type && (op == ReduceOp::kSum || op == ReduceOp::kAvg || op == ReduceOp::kMin || op == ReduceOp::kMax ||
                  op == ReduceOp::kProduct);
}

bool reduces(Op op) { return op == Op::kAllreduce || op == Op::kReduce || op == Op::kReduceScatter; }

size_t elementBytes(DataType dtype) { return dtype == DataType::kBytes ? 1 : elementSize(dtype); }

// Whether a cross-host call takes one Gloo operation over all ranks instead of the sliced form
// (the same on every rank: the bytes are agreed, the knobs checked equal, the rate agreed).
bool flatAcross(const Call& c, const Group& g, const Knobs& k) {
  if (!g.uniform) return true;  // hosts of unequal sizes: no slice groups
  // Compression happens in the slice groups only, after the host's full-precision reduction.
  if ((reduces(c.op) && compressesOnLink(c.dtype, c.redop, k)) || g.localSize == 1) return false;
  if (c.op == Op::kReduceScatter && !glooReduceScatters(c.dtype, c.redop)) return false;
  if (k.xhostAlgo == "sliced") return false;
  if (k.xhostAlgo == "flat") return true;
  if (c.op != Op::kBroadcast) return false;  // the sliced forms move the fewest bytes, on the link and in memory
  if (g.hosts == 2) return false;            // sliced: one send across, shared memory on the hosts
  return c.bytes < kFlatBroadcastMax || (fastLink(g.linkBytesPerSec) && c.bytes < kFastBroadcastMax);
}

const char* compressionOf(const Call& c, const Knobs& k, bool inSlices) {
  if (!reduces(c.op) || !compressesOnLink(c.dtype, c.redop, k)) return "none";
  if (k.xhostCompress == "int8" && !inSlices) return "none";  // int8 packets cross in the slice groups only
  return k.xhostCompress.c_str();
}

Plan planOneHost(const Call& c, const Group& g, const Knobs& k) {
  Plan p;
  p.route = Route::kShm;
  p.host = HostAlgo::kBuffered;
  switch (c.op) {
    case Op::kAllreduce:
    case Op::kReduce:
      p.host = allreduceOnHost(c.bytes, g.ranks, c.dtype, k.oneshotBytes, k.shmHalfBytes);
      p.stores = storesFor(c.bytes, k.shmStream);
      break;
    case Op::kAllgather: {
      const size_t threshold = g.singleCopyBytes == SIZE_MAX ? singleCopyOffer(g.ranks, g.amdCpu, k.singleCopyBytes)
                                                             : g.singleCopyBytes;
      if (singleCopyAllgather(c.bytes, g.ranks, threshold)) {
        p.host = HostAlgo::kSingleCopy;
      } else {
        p.stores = storesFor(c.bytes / std::max(g.ranks, 1), k.shmStream);  // each rank copies its input
      }
      break;
    }
    case Op::kReduceScatter:
    case Op::kBroadcast:
      p.stores = storesFor(c.bytes, k.shmStream);
      break;
    case Op::kAlltoall:  // the bytes for the peers
      p.stores = storesFor(c.bytes / std::max(g.ranks, 1) * (g.ranks - 1), k.shmStream);
      break;
    case Op::kScatter:  // the root copies every other rank's block
      p.stores = storesFor(c.bytes * (g.ranks - 1), k.shmStream);
      break;
    case Op::kGather:  // every rank copies its input
      p.stores = storesFor(c.bytes, k.shmStream);
      break;
    case Op::kBarrier:  // steps only
      p.host = HostAlgo::kNone;
      break;
  }
  if (g.ranks == 1) p.host = HostAlgo::kNone;
  return p;
}

Plan planAllreduce(const Call& c, const Group& g, const Knobs& k) {
  Plan p;
  const int H = g.hosts, L = g.localSize;
  const size_t esz = elementBytes(c.dtype);
  const int64_t n = static_cast<int64_t>(c.bytes / esz);
  const int64_t blk = (n + L - 1) / L;
  const uint64_t floor = chunkFloorBytes(g.linkBytesPerSec, k.xhostChunkBytes);
  if (flatAcross(c, g, k)) {
    p.route = Route::kFlat;
    p.link = LinkAlgo::kGlooAll;
    p.compress = compressionOf(c, k, false);
    return p;
  }
  p.route = Route::kSliced;
  p.reduceAsAllreduce = c.root && k.xhostAlgo == "auto" && c.bytes < kReduceAsAllreduceMax;
  const bool root = c.root && !p.reduceAsAllreduce;
  const bool compressed = compressesOnLink(c.dtype, c.redop, k);
  // From three hosts a reduce passes each chunk's partial up a chain of hosts ending at the root's
  // (each host adding its own), so each byte crosses each host link once (Gloo's reduce of the
  // slices: 59% of the root link's bound at 4 hosts, 16 MB). With one rank per host, only from
  // H - 1 chunks of the smallest size (4 hosts x 1, 1 Gbit/s, 1 MB: 0.95x gloo as a chain, 0.99x
  // without).
  const bool chains = root && H > 2 && !compressed;
  const bool chain = chains && (L > 1 || n >= (H - 1) * chunkElems(floor, esz, 0));
  p.compress = compressionOf(c, k, true);
  if (L == 1 && !chain) {
    // The slices are whole arrays and need no shared-memory phases: Gloo's all_reduce of them.
    p.link = LinkAlgo::kGlooSlices;
    return p;
  }
  p.host = HostAlgo::kReduceScatterAllgather;
  // A chain fills in H - 1 chunk times: its chunks are H - 1 times smaller (same floor).
  p.chunkBytes = static_cast<uint64_t>(chunkElems(floor, esz, chain ? blk / (H - 1) : blk)) * esz;
  const uint64_t padded = static_cast<uint64_t>(blk) * L * esz;
  if (chain) {
    p.link = LinkAlgo::kChain;
  } else if (H == 2 && !compressed && padded < kExchangeMaxBytes) {
    p.link = LinkAlgo::kSliceExchange;
  } else {
    p.link = LinkAlgo::kGlooSlices;
  }
  return p;
}

Plan planAcross(const Call& c, const Group& g, const Knobs& k) {
  if (c.op == Op::kAllreduce || c.op == Op::kReduce) return planAllreduce(c, g, k);
  Plan p;
  const int H = g.hosts, L = g.localSize;
  const uint64_t floor = chunkFloorBytes(g.linkBytesPerSec, k.xhostChunkBytes);
  const bool flat = flatAcross(c, g, k);
  p.route = flat ? Route::kFlat : Route::kSliced;
  switch (c.op) {
    case Op::kReduceScatter:
      if (!g.uniform) return planAllreduce(Call{Op::kAllreduce, c.bytes, c.dtype, c.redop}, g, k);  // kept block
      if (flat) {
        p.link = LinkAlgo::kGlooAll;
        break;
      }
      p.host = L > 1 ? HostAlgo::kBuffered : HostAlgo::kNone;
      p.link = LinkAlgo::kP2PBlocks;
      p.chunkBytes = static_cast<uint64_t>(chunkElems(floor, elementBytes(c.dtype),
                                                      static_cast<int64_t>(c.bytes / elementBytes(c.dtype)) /
                                                          g.ranks)) * elementBytes(c.dtype);
      break;
    case Op::kBroadcast:
      if (flat) {
        // Gloo's p2p from the root to every rank, posted and waited for on the calling thread up to
        // kP2PBroadcastMax: Gloo's collectives hand each operation to a worker thread and back,
        // which on busy cores cost small broadcasts more than the network did (hosts bench, 2 x 2
        // ranks unshaped, 4 alternating runs: p2p 0.88x-0.98x gloo's speed at 4-256 KB against
        // 0.84x-0.94x for Gloo's broadcast; at 1-2 MB 0.84x-0.89x against 0.96x-0.97x).
        p.link = c.bytes <= kP2PBroadcastMax ? LinkAlgo::kP2PFromRoot : LinkAlgo::kGlooAll;
        break;
      }
      p.host = L > 1 ? HostAlgo::kBuffered : HostAlgo::kNone;
      p.link = LinkAlgo::kChain;
      p.chunkBytes = static_cast<uint64_t>(chunkElems(floor, 1, static_cast<int64_t>(c.bytes) / (H - 1)));
      break;
    case Op::kAllgather:
      if (flat || !c.equalBlocks) {
        p.route = Route::kFlat;
        p.link = c.equalBlocks ? LinkAlgo::kGlooAll : LinkAlgo::kBroadcastEach;
        break;
      }
      p.host = L > 1 ? HostAlgo::kBuffered : HostAlgo::kNone;
      p.link = LinkAlgo::kGlooAllgatherSlices;
      p.chunkBytes = static_cast<uint64_t>(chunkElems(floor, 1, static_cast<int64_t>(c.bytes) / g.ranks));
      p.directGather = L > 1 && c.bytes >= kDirectGatherMin;
      break;
    case Op::kBarrier:
      p.route = Route::kFlat;
      p.host = L > 1 ? HostAlgo::kBuffered : HostAlgo::kNone;
      p.link = LinkAlgo::kP2PFirstRanks;
      break;
    default:  // gather, scatter, all_to_all: Gloo's, over all ranks
      p.route = Route::kFlat;
      p.link = LinkAlgo::kGlooAll;
      break;
  }
  return p;
}

}  // namespace

const char* opName(Op op) {
  switch (op) {
    case Op::kAllreduce: return "all_reduce";
    case Op::kReduce: return "reduce";
    case Op::kBroadcast: return "broadcast";
    case Op::kAllgather: return "all_gather";
    case Op::kReduceScatter: return "reduce_scatter";
    case Op::kGather: return "gather";
    case Op::kScatter: return "scatter";
    case Op::kAlltoall: return "all_to_all";
    case Op::kBarrier: return "barrier";
  }
  return "?";
}

const char* routeName(Route r) {
  switch (r) {
    case Route::kShm: return "shm";
    case Route::kSliced: return "sliced";
    case Route::kFlat: return "flat";
  }
  return "?";
}

const char* hostAlgoName(HostAlgo a) {
  switch (a) {
    case HostAlgo::kNone: return "-";
    case HostAlgo::kOneShot: return "one-shot";
    case HostAlgo::kReduceScatterAllgather: return "reduce-scatter+all-gather";
    case HostAlgo::kSingleCopy: return "single-copy";
    case HostAlgo::kBuffered: return "buffered";
  }
  return "?";
}

const char* linkAlgoName(LinkAlgo a) {
  switch (a) {
    case LinkAlgo::kNone: return "-";
    case LinkAlgo::kGlooAll: return "gloo over all ranks";
    case LinkAlgo::kGlooSlices: return "gloo in slices";
    case LinkAlgo::kSliceExchange: return "slice exchange";
    case LinkAlgo::kChain: return "chain of hosts";
    case LinkAlgo::kP2PFromRoot: return "p2p from root";
    case LinkAlgo::kGlooAllgatherSlices: return "gloo all_gather in slices";
    case LinkAlgo::kP2PBlocks: return "p2p blocks";
    case LinkAlgo::kBroadcastEach: return "gloo broadcast per rank";
    case LinkAlgo::kP2PFirstRanks: return "p2p first ranks";
  }
  return "?";
}

const char* storesName(Stores s) {
  switch (s) {
    case Stores::kOrdinary: return "ordinary";
    case Stores::kMeasured: return "measured";
    case Stores::kStreaming: return "streaming";
  }
  return "?";
}

std::string Plan::describe() const {
  std::string s = routeName(route);
  s += ": host ";
  s += hostAlgoName(host);
  if (route == Route::kShm) {
    if (host != HostAlgo::kNone && host != HostAlgo::kSingleCopy) (s += ", stores ") += storesName(stores);
    return s;
  }
  (s += ", link ") += linkAlgoName(link);
  if (std::string(compress) != "none") (s += " as ") += compress;
  if (reduceAsAllreduce) s += ", reduce as all_reduce";
  if (chunkBytes > 0) {
    char buf[48];
    if (chunkBytes >= (1u << 20) && chunkBytes % (1u << 20) == 0) {
      std::snprintf(buf, sizeof(buf), ", chunks %lluM", static_cast<unsigned long long>(chunkBytes >> 20));
    } else if (chunkBytes >= 1024 && chunkBytes % 1024 == 0) {
      std::snprintf(buf, sizeof(buf), ", chunks %lluK", static_cast<unsigned long long>(chunkBytes >> 10));
    } else {
      std::snprintf(buf, sizeof(buf), ", chunks %llu", static_cast<unsigned long long>(chunkBytes));
    }
    s += buf;
  }
  if (directGather) s += ", gathered in place";
  return s;
}

Plan plan(const Call& call, const Group& group, const Knobs& knobs) {
  Call c = call;
  if (c.op == Op::kReduce) c.root = true;
  return group.hosts > 1 ? planAcross(c, group, knobs) : planOneHost(c, group, knobs);
}

size_t oneshotLimit(int ranks, DataType dtype, size_t knob) {
  if (knob != SIZE_MAX) return knob;
  if (dtype == DataType::kFloat16 || dtype == DataType::kBFloat16) return 4u << 10;
  const size_t n = static_cast<size_t>(std::max(ranks, 1));
  return std::max<size_t>(4u << 10, std::min<size_t>(128u << 10, (256u << 10) / (n * n)));
}

HostAlgo allreduceOnHost(uint64_t bytes, int ranks, DataType dtype, size_t oneshotKnob, size_t halfBytes) {
  const bool oneShot = bytes <= oneshotLimit(ranks, dtype, oneshotKnob) && bytes <= halfBytes;
  return oneShot ? HostAlgo::kOneShot : HostAlgo::kReduceScatterAllgather;
}

size_t singleCopyOffer(int ranks, bool amdCpu, size_t knob) {
  if (knob != SIZE_MAX) return knob;
  if (ranks > kSingleCopyMaxRanks) return 0;
  return amdCpu ? kSingleCopyAmdMin : kSingleCopyMin;
}

bool singleCopyAllgather(uint64_t outBytes, int ranks, size_t groupThreshold) {
  return ranks > 1 && groupThreshold > 0 && outBytes >= groupThreshold && outBytes <= kSingleCopyMaxBytes;
}

Stores storesFor(uint64_t bytes, int shmStream) {
  if (shmStream == 1) return Stores::kStreaming;
  if (shmStream == 0 || bytes < kChooseMinBytes) return Stores::kOrdinary;
  return Stores::kMeasured;
}

bool storesSwitch(uint64_t mine, uint64_t other) { return 8 * other < kStoreSwitchEighths * mine; }

uint64_t storesCost(uint64_t old, uint64_t sample, bool trial) {
  if (old == 0 || trial) return sample;
  return (3 * old + std::min(sample, kStoreSampleCap * old)) / 4;
}

ShmWait shmWait(int localSize, int cores, bool multiHost, const Knobs& knobs) {
  const bool oversubscribed = localSize > cores || multiHost;
  ShmWait w;
  w.spinUs = knobs.spinUs >= 0 ? knobs.spinUs : (oversubscribed ? kOversubscribedSpinUs : kSpinUs);
  w.yieldUs = knobs.yieldUs >= 0 ? knobs.yieldUs : (oversubscribed ? kOversubscribedYieldUs : kYieldUs);
  return w;
}

bool fastLink(double linkBytesPerSec) { return linkBytesPerSec > kFastLink; }

bool measuresLink(const Group& group, const Knobs& knobs) {
  return group.hosts > 1 && group.uniform && group.localSize > 1 && knobs.xhostAlgo == "auto";
}

uint64_t chunkFloorBytes(double linkBytesPerSec, size_t knob) {
  if (knob) return knob;
  return fastLink(linkBytesPerSec) ? kFastChunkBytes : kSlowChunkBytes;
}

int64_t chunkElems(uint64_t floorBytes, size_t elementBytes, int64_t total) {
  const int64_t floor = std::max<int64_t>(1, static_cast<int64_t>(floorBytes / elementBytes));
  return std::max(floor, (total + 7) / 8);
}

bool compressesOnLink(DataType dtype, ReduceOp op, const Knobs& knobs) {
  return dtype == DataType::kFloat32 && (op == ReduceOp::kSum || op == ReduceOp::kAvg) &&
         knobs.xhostCompress != "none";
}

}  // namespace tdx::tuning
