// The one round-up helper: the smallest multiple of `m` (> 0) that is >= `v`, in v's type.
#pragma once

namespace tdx {

template <typename T, typename M>
constexpr T roundUp(T v, M m) {
  const T step = static_cast<T>(m);
  return (v + step - 1) / step * step;
}

}  // namespace tdx
