// Protobuf's wire format for the few fields of the bulk messages (GradChunk,
// ParamChunk), so that both edges can build them around bytes they own or
// borrow instead of copying those bytes into a message: the same messages on
// the wire, without protobuf's copies of `bytes` fields (docs/design.md,
// section 10.2).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <vector>

#include "absl/strings/string_view.h"
#include "base/pieces.h"

namespace shardopt::wire {

void AppendVarintField(std::string* out, int field, uint64_t value);
void AppendBytesField(std::string* out, int field, absl::string_view bytes);
// A bytes field's tag and length: the bytes themselves follow in another slice.
void AppendBytesHeader(std::string* out, int field, uint64_t length);

// One top-level field of a serialized message, located in its bytes.
struct Field {
  int number = 0;
  int wire_type = 0;    // 0 varint, 1 fixed64, 2 length-delimited, 5 fixed32
  uint64_t begin = 0;   // the tag's first byte
  uint64_t value = 0;   // the value's first byte: after the length, for wire type 2
  uint64_t end = 0;     // one past the field's last byte
};
inline constexpr int kLengthDelimited = 2;

// The message's top-level fields in order, without copying any value. False
// if the bytes are not a well-formed message, if they hold a group (wire
// types 3 and 4, which no message of ours uses), or a tag or a length in more
// than 5 bytes or from 2^31 - 64 on: leave those to protobuf's parser, which
// knows its own rules for them. True only where protobuf reads the same
// fields.
bool ScanFields(const Pieces& message, std::vector<Field>* fields);
// The same, stopping at the first field past `max_fields`: false, with
// `*too_many`, for a message of more (a caller that refuses such messages
// need not hold 32 bytes for each field of one, 2 bytes on the wire).
bool ScanFields(const Pieces& message, std::vector<Field>* fields, size_t max_fields, bool* too_many);
// The varint a view starts with (a varint field's value); false if malformed.
bool ReadVarint(const Pieces& bytes, uint64_t* v);

}  // namespace shardopt::wire
