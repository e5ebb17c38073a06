// A number in as few significant digits as read back as its every bit,
// trying 15, 16 and 17 (6 to 9 for a float): absl::StrCat keeps 6, which
// tells two numbers apart only down to there (an error saying "0.01 differs
// from 0.01"), and %.17g writes 0.1 as 0.10000000000000001. (Fewer than 15
// are not tried, so 5e-324 comes out as 4.94065645841247e-324.)
#pragma once

#include <cstdlib>
#include <string>

#include "absl/strings/str_format.h"

namespace shardopt {

// Finite values; NaN and Inf come out as printf writes them.
inline std::string ShortestNumber(double v) {
  std::string out;
  for (int digits = 15; digits <= 17; ++digits) {
    out = absl::StrFormat("%.*g", digits, v);
    if (std::strtod(out.c_str(), nullptr) == v) break;
  }
  return out;
}

inline std::string ShortestNumber(float v) {
  std::string out;
  for (int digits = 6; digits <= 9; ++digits) {
    out = absl::StrFormat("%.*g", digits, v);
    if (std::strtof(out.c_str(), nullptr) == v) break;
  }
  return out;
}

}  // namespace shardopt
