#include "rpc/wire_format.h"

#include <cstdint>

namespace shardopt::wire {
namespace {

constexpr int kVarint = 0;
constexpr int kFixed64 = 1;
constexpr int kFixed32 = 5;
constexpr uint64_t kLargestLength = (uint64_t{1} << 31) - 64;

void AppendVarint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

// A varint of at most `max_bytes` bytes: 10 for a value, as protobuf reads
// them, and 5 for a tag or a length, which protobuf reads as 32-bit and
// refuses longer.
bool NextVarint(Pieces::Cursor* in, uint64_t* v, int max_bytes = 10) {
  *v = 0;
  for (int shift = 0; shift < 7 * max_bytes; shift += 7) {
    uint8_t byte;
    if (!in->Next(&byte)) return false;
    if (shift < 64) *v |= uint64_t{byte & 0x7Fu} << shift;
    if ((byte & 0x80) == 0) return true;
  }
  return false;
}

}  // namespace

bool ScanFields(const Pieces& message, std::vector<Field>* fields) {
  bool too_many = false;
  return ScanFields(message, fields, SIZE_MAX, &too_many);
}

bool ScanFields(const Pieces& message, std::vector<Field>* fields, size_t max_fields, bool* too_many) {
  fields->clear();
  *too_many = false;
  Pieces::Cursor in(message);
  while (in.position() < message.size()) {
    if (fields->size() == max_fields) {
      *too_many = true;
      return false;
    }
    Field f;
    f.begin = in.position();
    uint64_t tag;
    if (!NextVarint(&in, &tag, 5) || tag > 0xFFFFFFFFu || (tag >> 3) == 0) return false;
    f.number = static_cast<int>(tag >> 3);
    f.wire_type = static_cast<int>(tag & 7);
    uint64_t n = 0;
    switch (f.wire_type) {
      case kVarint:
        f.value = in.position();
        if (!NextVarint(&in, &n)) return false;
        break;
      case kFixed64:
        f.value = in.position();
        if (!in.Skip(8)) return false;
        break;
      case kLengthDelimited:
        // Protobuf refuses lengths from a little under 2^31 on; these are
        // left to it whole.
        if (!NextVarint(&in, &n, 5) || n >= kLargestLength) return false;
        f.value = in.position();
        if (!in.Skip(n)) return false;
        break;
      case kFixed32:
        f.value = in.position();
        if (!in.Skip(4)) return false;
        break;
      default:  // groups, and wire types that do not exist
        return false;
    }
    f.end = in.position();
    fields->push_back(f);
  }
  return true;
}

bool ReadVarint(const Pieces& bytes, uint64_t* v) {
  Pieces::Cursor in(bytes);
  return NextVarint(&in, v);
}

void AppendVarintField(std::string* out, int field, uint64_t value) {
  AppendVarint(out, (uint64_t(field) << 3) | kVarint);
  AppendVarint(out, value);
}

void AppendBytesHeader(std::string* out, int field, uint64_t length) {
  AppendVarint(out, (uint64_t(field) << 3) | kLengthDelimited);
  AppendVarint(out, length);
}

void AppendBytesField(std::string* out, int field, absl::string_view bytes) {
  AppendBytesHeader(out, field, bytes.size());
  out->append(bytes.data(), bytes.size());
}

}  // namespace shardopt::wire
