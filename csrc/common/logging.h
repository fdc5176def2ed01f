// Error reporting for the torch-free layers (common, transport, collectives).
//
// tdx::Error is what those layers throw; the backend turns it into a c10 error
// so Python sees a RuntimeError subclass with the same text.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace tdx {

// Base error for every failure raised below the backend layer.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

// A wait that ran past the group's timeout (names op, sequence and ranks).
class TimeoutError : public Error {
 public:
  explicit TimeoutError(const std::string& msg) : Error(msg) {}
};

// A peer the operation waited for exited or reported a failure of its own.
class PeerFailedError : public Error {
 public:
  explicit PeerFailedError(const std::string& msg) : Error(msg) {}
};

// The group was aborted or shut down while an operation was waiting.
class AbortedError : public Error {
 public:
  explicit AbortedError(const std::string& msg) : Error(msg) {}
};

// This rank was excluded from the group by its peers (it made no progress for the stuck time, or a
// shrink left it out): it can take no further part in the group.
class ExcludedError : public Error {
 public:
  explicit ExcludedError(const std::string& msg) : Error(msg) {}
};

namespace detail {
inline void streamAll(std::ostringstream&) {}
template <typename T, typename... Rest>
void streamAll(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  streamAll(os, rest...);
}
}  // namespace detail

// Concatenates its arguments with operator<<.
template <typename... Args>
std::string str(const Args&... args) {
  std::ostringstream os;
  detail::streamAll(os, args...);
  return os.str();
}

}  // namespace tdx

// User-facing condition: throws tdx::Error with the given message parts.
#define TDX_ENFORCE(cond, ...)                                 \
  do {                                                         \
    if (!(cond)) {                                             \
      throw ::tdx::Error(::tdx::str("tdx: ", __VA_ARGS__));    \
    }                                                          \
  } while (0)

// Internal invariants: print both operands and file:line.
#define TDX_CHECK_OP_(a, b, op)                                               \
  do {                                                                        \
    const auto& tdx_a_ = (a);                                                 \
    const auto& tdx_b_ = (b);                                                 \
    if (!(tdx_a_ op tdx_b_)) {                                                \
      throw ::tdx::Error(::tdx::str("tdx internal check failed at ", __FILE__, \
                                    ":", __LINE__, ": ", #a " " #op " " #b,     \
                                    " (", tdx_a_, " vs ", tdx_b_, ")"));      \
    }                                                                         \
  } while (0)

#define TDX_CHECK_EQ(a, b) TDX_CHECK_OP_(a, b, ==)
#define TDX_CHECK_NE(a, b) TDX_CHECK_OP_(a, b, !=)
#define TDX_CHECK_LE(a, b) TDX_CHECK_OP_(a, b, <=)
#define TDX_CHECK_LT(a, b) TDX_CHECK_OP_(a, b, <)
#define TDX_CHECK_GE(a, b) TDX_CHECK_OP_(a, b, >=)
#define TDX_CHECK(cond)                                                        \
  do {                                                                         \
    if (!(cond)) {                                                             \
      throw ::tdx::Error(::tdx::str("tdx internal check failed at ", __FILE__, \
                                    ":", __LINE__, ": ", #cond));              \
    }                                                                          \
  } while (0)
