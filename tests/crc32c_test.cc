// crc32c, which guards every checkpoint file: the standard check values, and
// the same value as a bit-at-a-time reference at many lengths (the
// instruction's 8-byte steps and their tails), at every alignment, whole or
// extended piece by piece.
#include "checkpoint/crc32c.h"

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace shardopt::checkpoint {
namespace {

// The definition, one bit at a time (reflected, polynomial 0x82F63B78).
uint32_t BitwiseCrc32c(const uint8_t* p, size_t n) {
  uint32_t c = ~0u;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ ((c & 1) ? 0x82F63B78u : 0);
  }
  return ~c;
}

TEST(Crc32c, StandardCheckValues) {
  EXPECT_EQ(Crc32c("123456789", 9), 0xE3069283u);
  // RFC 3720, B.4: 32 bytes of zeros, of ones, and 0x00 ... 0x1F.
  std::vector<uint8_t> b(32, 0);
  EXPECT_EQ(Crc32c(b.data(), b.size()), 0x8A9136AAu);
  std::fill(b.begin(), b.end(), 0xFF);
  EXPECT_EQ(Crc32c(b.data(), b.size()), 0x62A8AB43u);
  for (int i = 0; i < 32; ++i) b[i] = static_cast<uint8_t>(i);
  EXPECT_EQ(Crc32c(b.data(), b.size()), 0x46DD794Eu);
}

TEST(Crc32c, EqualsTheDefinitionAtManyLengthsEveryAlignmentWholeOrSplit) {
  const uint64_t seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937_64 rng(seed);
  constexpr size_t kRound = 3 * 8192;
  std::vector<uint8_t> data(3 * kRound + 4096 + 64);
  for (auto& x : data) x = static_cast<uint8_t>(rng());
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{4096}, kRound - 1, kRound, kRound + 1, 2 * kRound + 13,
                   3 * kRound + 4096}) {
    for (size_t at = 0; at < 8; ++at) {
      const uint8_t* p = data.data() + at;
      const uint32_t expected = BitwiseCrc32c(p, n);
      EXPECT_EQ(Crc32c(p, n), expected) << "n=" << n << " at=" << at;
      const size_t cut = n == 0 ? 0 : rng() % n;  // extended in two pieces
      EXPECT_EQ(Crc32c(p + cut, n - cut, Crc32c(p, cut)), expected) << "n=" << n << " at=" << at << " cut=" << cut;
    }
  }
}

}  // namespace
}  // namespace shardopt::checkpoint
