// Element types, reduce ops and byte spans shared by every collective. No torch types.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace tdx {

enum class DataType : uint8_t {
  kFloat32, kFloat64, kFloat16, kBFloat16, kInt8, kInt16, kInt32, kInt64, kUInt8, kBool,
  kBytes,  // opaque bytes: only for data movement, never reduced
};

enum class ReduceOp : uint8_t { kSum, kAvg, kProduct, kMin, kMax, kBand, kBor, kBxor };

size_t elementSize(DataType dt);
const char* dataTypeName(DataType dt);
const char* reduceOpName(ReduceOp op);
bool isFloating(DataType dt);
// Whether `op` is defined for `dt` (bitwise ops need integers or bool; AVG needs floats).
bool reduceOpSupported(DataType dt, ReduceOp op);

// A contiguous byte range in a rank's own memory.
struct Span {
  char* ptr;
  size_t bytes;
};

// Several spans seen as one logical byte array (a coalesced operation's tensors).
class SpanList {
 public:
  SpanList() = default;
  SpanList(void* ptr, size_t bytes) { add(ptr, bytes); }
  void add(const void* ptr, size_t bytes) {
    spans_.push_back(Span{static_cast<char*>(const_cast<void*>(ptr)), bytes});
    total_ += bytes;
  }
  size_t total() const { return total_; }
  bool empty() const { return total_ == 0; }
  const std::vector<Span>& spans() const { return spans_; }

  // Calls f(char* ptr, size_t logicalOffset, size_t n) for each piece of [off, off + len).
  template <typename F>
  void forEach(size_t off, size_t len, F&& f) const {
    size_t base = 0;
    for (const Span& s : spans_) {
      if (len == 0) break;
      if (off < base + s.bytes) {
        size_t inner = off - base;
        size_t n = s.bytes - inner < len ? s.bytes - inner : len;
        f(s.ptr + inner, off, n);
        off += n;
        len -= n;
      }
      base += s.bytes;
    }
  }
  // Copies logical bytes [off, off + len) into dst with copy(dst, src, n) (e.g. a PeerCopy).
  template <typename Copy>
  void copyOut(size_t off, size_t len, char* dst, Copy&& copy) const {
    forEach(off, len, [&](char* p, size_t o, size_t n) { copy(dst + (o - off), p, n); });
  }
  void copyOut(size_t off, size_t len, char* dst) const {
    copyOut(off, len, dst, [](char* d, const char* src, size_t n) { std::memcpy(d, src, n); });
  }
  // Copies src into logical bytes [off, off + len).
  void copyIn(size_t off, size_t len, const char* src) const {
    forEach(off, len, [&](char* p, size_t o, size_t n) { std::memcpy(p, src + (o - off), n); });
  }

 private:
  std::vector<Span> spans_;
  size_t total_ = 0;
};

}  // namespace tdx
