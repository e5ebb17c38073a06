// Pieces of the server's error messages, so that every refusal names things
// the same way.
#pragma once

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace shardopt {

inline std::string Range(uint64_t begin, uint64_t end) { return absl::StrCat("[", begin, ", ", end, ")"); }

// A caller-supplied name, quoted and cut short: the message travels in gRPC's
// metadata, which a long name would overflow (the caller would then see
// RESOURCE_EXHAUSTED instead of the refusal).
inline std::string Quote(absl::string_view name) {
  constexpr size_t kShown = 64;
  if (name.size() <= kShown) return absl::StrCat("'", name, "'");
  return absl::StrCat("'", name.substr(0, kShown), "...' (", name.size(), " bytes)");
}

}  // namespace shardopt
