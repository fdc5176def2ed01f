#include "common/env.h"

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <string>

#include "common/logging.h"

namespace tdx {

size_t parseSize(const char* name, const char* text) {
  std::string s(text);
  char* end = nullptr;
  unsigned long long v = std::strtoull(s.c_str(), &end, 10);
  TDX_ENFORCE(end != s.c_str(), name, "='", s, "' is not a size; use a number of bytes such as 65536, 64K or 8M");
  std::string suffix(end);
  unsigned long long mult = 1;
  if (suffix == "" || suffix == "B") {
    mult = 1;
  } else if (suffix == "K" || suffix == "k" || suffix == "KB" || suffix == "KiB") {
    mult = 1ull << 10;
  } else if (suffix == "M" || suffix == "m" || suffix == "MB" || suffix == "MiB") {
    mult = 1ull << 20;
  } else if (suffix == "G" || suffix == "g" || suffix == "GB" || suffix == "GiB") {
    mult = 1ull << 30;
  } else {
    TDX_ENFORCE(false, name, "='", s, "' has an unknown suffix '", suffix, "'; use K, M or G");
  }
  return static_cast<size_t>(v * mult);
}

double parseSeconds(const char* name, const char* text) {
  std::string s(text);
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  TDX_ENFORCE(end != s.c_str() && *end == '\0', name, "='", s, "' is not a number of seconds (e.g. 5)");
  TDX_ENFORCE(v > 0 && std::isfinite(v), name, "='", s, "' must be > 0 seconds");
  return v;
}

namespace {

size_t sizeKnob(const char* name, size_t dflt) {
  const char* v = std::getenv(name);
  return (v && *v) ? parseSize(name, v) : dflt;
}

int intKnob(const char* name, int dflt) {
  const char* v = std::getenv(name);
  if (!v || !*v) return dflt;  // may be -1: "choose automatically"
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  TDX_ENFORCE(*end == '\0' && x >= 0, name, "='", v, "' must be a non-negative integer");
  return static_cast<int>(x);
}

EnvKnobs load() {
  EnvKnobs k;
  k.bufferBytes = sizeKnob("TDX_BUFFER_BYTES", k.bufferBytes);
  TDX_ENFORCE(k.bufferBytes >= 4096, "TDX_BUFFER_BYTES=", k.bufferBytes, " is too small; use at least 4096");
  k.oneshotBytes = sizeKnob("TDX_ONESHOT_BYTES", k.oneshotBytes);
  k.singleCopyBytes = sizeKnob("TDX_SINGLE_COPY_BYTES", k.singleCopyBytes);
  k.p2pRingBytes = sizeKnob("TDX_P2P_RING_BYTES", k.p2pRingBytes);
  TDX_ENFORCE(k.p2pRingBytes >= 4096, "TDX_P2P_RING_BYTES=", k.p2pRingBytes, " is too small; use at least 4096");
  k.spinUs = intKnob("TDX_SPIN_US", k.spinUs);
  k.yieldUs = intKnob("TDX_YIELD_US", k.yieldUs);
  k.debug = intKnob("TDX_DEBUG", 0) != 0;
  if (const char* c = std::getenv("TDX_CUDA_PATH"); c && *c) k.cudaPath = c;
  k.xhostChunkBytes = sizeKnob("TDX_XHOST_CHUNK_BYTES", k.xhostChunkBytes);
  if (const char* c = std::getenv("TDX_XHOST_COMPRESS"); c && *c) k.xhostCompress = c;
  TDX_ENFORCE(k.xhostCompress == "none" || k.xhostCompress == "bf16" || k.xhostCompress == "fp16" ||
                  k.xhostCompress == "int8",
              "TDX_XHOST_COMPRESS='", k.xhostCompress, "' is not one of none, bf16, fp16, int8");
  if (const char* a = std::getenv("TDX_XHOST_ALGO"); a && *a) k.xhostAlgo = a;
  TDX_ENFORCE(k.xhostAlgo == "auto" || k.xhostAlgo == "sliced" || k.xhostAlgo == "flat",
              "TDX_XHOST_ALGO='", k.xhostAlgo, "' is not one of auto, sliced, flat");
  TDX_ENFORCE(k.xhostChunkBytes == 0 || k.xhostChunkBytes >= 4096, "TDX_XHOST_CHUNK_BYTES=", k.xhostChunkBytes,
              " is too small; use at least 4096 (or 0 to choose from the link)");
  if (const char* f = std::getenv("TDX_FAILURE_DETECTION_S"); f && *f) {
    k.failureDetectionS = parseSeconds("TDX_FAILURE_DETECTION_S", f);
  }
  if (const char* d = std::getenv("TORCH_DISTRIBUTED_DEBUG"); d && std::string(d) == "DETAIL") k.debug = true;
  return k;
}

}  // namespace

bool ddpDirect() {
  const char* direct = std::getenv("TDX_DDP_DIRECT");
  return !(direct && std::string(direct) == "0");
}

const EnvKnobs& env() {
  static const EnvKnobs knobs = load();
  return knobs;
}

bool reduceIsaGeneric() {
  const char* isa = std::getenv("TDX_REDUCE_ISA");
  return isa != nullptr && std::string(isa) == "generic";
}

bool reduceIsaWithoutAvx512() {
  const char* isa = std::getenv("TDX_REDUCE_ISA");
  return reduceIsaGeneric() || (isa != nullptr && std::string(isa) == "avx2");
}

int shmStreamStores() {
  const char* v = std::getenv("TDX_SHM_STREAM");
  if (v == nullptr || *v == '\0' || std::string(v) == "auto") return -1;
  TDX_ENFORCE(std::string(v) == "0" || std::string(v) == "1", "TDX_SHM_STREAM='", v,
              "' is not one of 0, 1, auto");
  return v[0] == '1' ? 1 : 0;
}

bool cpuIsAmd() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();  // may run in a static initializer, before libgcc's own
  return __builtin_cpu_is("amd");
#else
  return false;
#endif
}

bool phaseTimes() {
  const char* v = std::getenv("TDX_PHASE_TIMES");
  return v != nullptr && std::string(v) == "1";
}

}  // namespace tdx
