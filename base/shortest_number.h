// A number in as few significant digits as read back as its every bit,
// trying 15, 16 and 17 (6 to 9 for a float): absl::StrCat keeps 6, which
// tells two numbers apart only down to there (an error saying "0.01 differs
// from 0.01"), and %.17g writes 0.1 as 0.10000000000000001. (Fewer than 15
// are not tried, so 5e-324 comes out as 4.94065645841247e-324.)
#pragma once

#include <cstdlib>
#include <string>
#include <type_traits>

#include "absl/strings/str_format.h"

namespace shardopt {

// Finite values; NaN and Inf come out as printf writes them.
template <typename T>
std::string ShortestNumber(T v) {
  static_assert(std::is_same_v<T, double> || std::is_same_v<T, float>);
  constexpr bool kFloat = std::is_same_v<T, float>;
  std::string out;
  for (int digits = kFloat ? 6 : 15; digits <= (kFloat ? 9 : 17); ++digits) {
    out = absl::StrFormat("%.*g", digits, v);
    // strtof for a float: strtod then a cast would round twice.
    const T back = kFloat ? std::strtof(out.c_str(), nullptr) : std::strtod(out.c_str(), nullptr);
    if (back == v) break;
  }
  return out;
}

}  // namespace shardopt
