#include "tuning/knobs.h"

#include <cctype>

#include "common/env.h"
#include "common/logging.h"
#include "common/round_up.h"

namespace tdx::tuning {

Knobs knobsFromEnv() {
  const EnvKnobs& e = env();
  Knobs k;
  k.xhostAlgo = e.xhostAlgo;
  k.xhostCompress = e.xhostCompress;
  k.xhostChunkBytes = e.xhostChunkBytes;
  k.oneshotBytes = e.oneshotBytes;
  k.singleCopyBytes = e.singleCopyBytes;
  k.shmStream = shmStreamStores();
  k.shmHalfBytes = roundUp<size_t>(e.bufferBytes, 4096);  // as the shared-memory group rounds it (to a page)
  k.spinUs = e.spinUs;
  k.yieldUs = e.yieldUs;
  return k;
}

namespace {

// The value of `names` (by index) that `name` spells, else a tdx::Error naming `what` and the choices.
template <class T>
T parse(const char* what, const std::string& name, int count, const char* (*nameOf)(T)) {
  std::string choices;
  for (int i = 0; i < count; ++i) {
    const std::string n = nameOf(static_cast<T>(i));
    bool same = n.size() == name.size();
    for (size_t c = 0; same && c < n.size(); ++c) same = std::tolower(n[c]) == std::tolower(name[c]);
    if (same) return static_cast<T>(i);
    choices += (i ? ", " : "") + n;
  }
  throw Error(str("tdx: unknown ", what, " '", name, "'; use one of ", choices));
}

}  // namespace

Op parseOp(const std::string& name) { return parse<Op>("collective", name, 9, &opName); }
DataType parseDtype(const std::string& name) { return parse<DataType>("dtype", name, 11, &dataTypeName); }
ReduceOp parseRedop(const std::string& name) { return parse<ReduceOp>("reduce op", name, 8, &reduceOpName); }

}  // namespace tdx::tuning
