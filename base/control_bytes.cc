#include "base/control_bytes.h"

#include "absl/strings/str_cat.h"

namespace shardopt {

std::string EscapeControlBytes(absl::string_view text, absl::string_view backslashed) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (u < 0x20 || u == 0x7f) {
      absl::StrAppend(&out, "\\x", absl::Hex(u, absl::kZeroPad2));
      continue;
    }
    if (backslashed.find(c) != absl::string_view::npos) out += '\\';
    out += c;
  }
  return out;
}

}  // namespace shardopt
