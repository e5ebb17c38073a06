// Protobuf's wire format for the few fields of the bulk messages (GradChunk,
// ParamChunk), so that both edges can build them around bytes they own or
// borrow instead of copying those bytes into a message: the same messages on
// the wire, without protobuf's copies of `bytes` fields (docs/design.md,
// section 10.2).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace shardopt::wire {

void AppendVarintField(std::string* out, int field, uint64_t value);
void AppendBytesField(std::string* out, int field, absl::string_view bytes);
// A bytes field's tag and length: the bytes themselves follow in another slice.
void AppendBytesHeader(std::string* out, int field, uint64_t length);

}  // namespace shardopt::wire
