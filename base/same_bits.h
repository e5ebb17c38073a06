// Whether two numbers are the same bits: what a retried or repeated request
// must carry. Unlike ==, NaN equals itself, and 0.0 differs from -0.0.
#pragma once

#include <cstring>
#include <type_traits>

namespace shardopt {

template <typename T>
bool SameBits(T a, T b) {
  static_assert(std::is_floating_point_v<T>);
  return std::memcmp(&a, &b, sizeof a) == 0;
}

}  // namespace shardopt
