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
inline constexpr size_t kQuotedBytes = 64;
inline std::string Quote(absl::string_view name) {
  if (name.size() <= kQuotedBytes) return absl::StrCat("'", name, "'");
  // Cut between UTF-8 characters, never inside one: half a character made
  // the message itself invalid UTF-8 (an outside probe).
  size_t cut = kQuotedBytes;
  while (cut > 0 && (static_cast<unsigned char>(name[cut]) & 0xC0) == 0x80) --cut;
  return absl::StrCat("'", name.substr(0, cut), "...' (", name.size(), " bytes)");
}

// As Quote, with the name's size also when it is shown whole.
inline std::string QuoteWithSize(absl::string_view name) {
  if (name.size() > kQuotedBytes) return Quote(name);
  return absl::StrCat(Quote(name), " (", name.size(), " bytes)");
}

}  // namespace shardopt
