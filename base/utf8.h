// Whether bytes are UTF-8 as protobuf requires of a proto3 string field:
// shortest forms only, no surrogates, nothing past U+10FFFF. A client checks
// its names so, since protobuf sends one that is not (logging an error to
// the caller's stderr) and the server then refuses the whole message.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace shardopt {

inline bool IsUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto byte = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
    const uint8_t b = byte(i);
    if (b < 0x80) {
      ++i;
      continue;
    }
    // The sequence's length, and the range its second byte must lie in:
    // narrower than 80..BF where a wider first byte would be an overlong
    // form, a surrogate (ED A0..BF) or past U+10FFFF (F4 90..).
    size_t n = 0;
    uint8_t lo = 0x80, hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) n = 2;
    else if (b == 0xE0) n = 3, lo = 0xA0;
    else if (b == 0xED) n = 3, hi = 0x9F;
    else if (b >= 0xE1 && b <= 0xEF) n = 3;
    else if (b == 0xF0) n = 4, lo = 0x90;
    else if (b >= 0xF1 && b <= 0xF3) n = 4;
    else if (b == 0xF4) n = 4, hi = 0x8F;
    else return false;
    if (s.size() - i < n || byte(i + 1) < lo || byte(i + 1) > hi) return false;
    for (size_t k = 2; k < n; ++k) {
      if (byte(i + k) < 0x80 || byte(i + k) > 0xBF) return false;
    }
    i += n;
  }
  return true;
}

}  // namespace shardopt
