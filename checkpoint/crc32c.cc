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
// The instruction takes 3 cycles and can start one a cycle, so one chain of
// them runs at a third of the core's rate. Rounds of three lanes of kLane
// bytes each run three independent chains, joined after each round: the
// crc register is linear in (register, data), so
//   reg(r, A B C) = Z(Z(reg(r, A)) ^ reg(0, B)) ^ reg(0, C),
// where Z(x) = reg(x, kLane zero bytes), a linear map of 32 bits kept as
// four byte tables. Here: 9 GB/s on one chain, about three times that in
// rounds; a restore checks every byte it reads with it.
constexpr size_t kLane = 8192;

__attribute__((target("sse4.2"))) uint32_t ZeroExtend(uint32_t reg, size_t n) {
  uint64_t c = reg;
  for (size_t i = 0; i < n / 8; ++i) c = __builtin_ia32_crc32di(c, 0);
  return static_cast<uint32_t>(c);
}

struct LaneShift {
  uint32_t t[4][256];
  LaneShift() {
    uint32_t basis[32];
    for (int i = 0; i < 32; ++i) basis[i] = ZeroExtend(uint32_t{1} << i, kLane);
    for (int k = 0; k < 4; ++k) {
      for (uint32_t b = 0; b < 256; ++b) {
        uint32_t v = 0;
        for (int j = 0; j < 8; ++j) {
          if ((b >> j) & 1) v ^= basis[8 * k + j];
        }
        t[k][b] = v;
      }
    }
  }
  uint32_t operator()(uint32_t x) const {
    return t[0][x & 0xFF] ^ t[1][(x >> 8) & 0xFF] ^ t[2][(x >> 16) & 0xFF] ^ t[3][x >> 24];
  }
};

__attribute__((target("sse4.2"))) uint32_t Crc32cHardwareUpdate(uint32_t crc, const uint8_t* p, size_t n) {
  static const LaneShift shift;
  uint64_t c = crc;
  for (; n >= 3 * kLane; n -= 3 * kLane, p += 3 * kLane) {
    uint64_t c1 = 0, c2 = 0;
    for (size_t i = 0; i < kLane; i += 8) {
      uint64_t w0, w1, w2;
      std::memcpy(&w0, p + i, 8);
      std::memcpy(&w1, p + kLane + i, 8);
      std::memcpy(&w2, p + 2 * kLane + i, 8);
      c = __builtin_ia32_crc32di(c, w0);
      c1 = __builtin_ia32_crc32di(c1, w1);
      c2 = __builtin_ia32_crc32di(c2, w2);
    }
    c = shift(shift(static_cast<uint32_t>(c)) ^ static_cast<uint32_t>(c1)) ^ static_cast<uint32_t>(c2);
  }
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
