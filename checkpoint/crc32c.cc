#include "checkpoint/crc32c.h"

#include <cstring>

namespace shardopt::checkpoint {
namespace {

// crc32c (Castagnoli), reflected. The SSE4.2 instruction when the CPU has it,
// a table otherwise; both give the same value.
struct Crc32cTable {
  uint32_t t[256];
  Crc32cTable() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1) ? 0x82F63B78u : 0);
      t[i] = c;
    }
  }
};

uint32_t Crc32cTableUpdate(uint32_t crc, const uint8_t* p, size_t n) {
  static const Crc32cTable table;
  for (size_t i = 0; i < n; ++i) crc = table.t[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t Crc32cHardwareUpdate(uint32_t crc, const uint8_t* p, size_t n) {
  uint64_t c = crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c = __builtin_ia32_crc32di(c, w);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; n > 0; --n, ++p) c32 = __builtin_ia32_crc32qi(c32, *p);
  return c32;
}
#endif

}  // namespace

uint32_t Crc32c(const void* data, size_t n, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  static const bool hardware = __builtin_cpu_supports("sse4.2");
  crc = hardware ? Crc32cHardwareUpdate(crc, p, n) : Crc32cTableUpdate(crc, p, n);
#else
  crc = Crc32cTableUpdate(crc, p, n);
#endif
  return ~crc;
}

}  // namespace shardopt::checkpoint
