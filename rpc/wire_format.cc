#include "rpc/wire_format.h"

namespace shardopt::wire {
namespace {

constexpr int kVarint = 0;
constexpr int kLengthDelimited = 2;

void AppendVarint(std::string* out, uint64_t v) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

}  // namespace

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
