// The CPU loops' accumulate takes its source at any address: a gradient is
// folded straight from a received message's pieces. This test links the
// loops built with every load checked against its type's alignment
// (kernels/CMakeLists.txt), so it stops at a load that the compiler was told
// is aligned. x86 forgives such a load, so no other test would see it; the
// compiler may still rely on it (vectorizing with aligned loads).
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/adamw_math.h"
#include "kernels/cpu/loops.h"

namespace shardopt::cpu {
namespace {

TEST(LoopsAlignment, AccumulateReadsItsSourceAtEveryAddressInEveryIsa) {
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> value(-4.0f, 4.0f);
  for (Isa isa : SupportedIsas()) {
    for (DType dtype : {DType::kFp32, DType::kBf16}) {
      const size_t esize = DTypeSize(dtype);
      for (uint64_t n : {1u, 15u, 16u, 17u, 1000u}) {
        // The values, and what each widens to.
        std::vector<unsigned char> bytes(n * esize);
        std::vector<float> widened(n);
        for (uint64_t i = 0; i < n; ++i) {
          const float f = value(rng);
          if (dtype == DType::kFp32) {
            widened[i] = f;
            std::memcpy(&bytes[i * 4], &f, 4);
          } else {
            const uint16_t h = math::float_to_bf16(f);
            widened[i] = math::bf16_to_float(h);
            std::memcpy(&bytes[i * 2], &h, 2);
          }
        }
        for (size_t shift = 0; shift < 4; ++shift) {
          std::vector<unsigned char> at(n * esize + shift);
          std::memcpy(at.data() + shift, bytes.data(), bytes.size());
          std::vector<float> acc(n);
          std::memset(acc.data(), 0xff, n * sizeof(float));  // NaNs, which no result is
          Loops(isa).accumulate(acc.data(), at.data() + shift, dtype, n, /*first=*/true);
          for (uint64_t i = 0; i < n; ++i) {
            ASSERT_EQ(math::float_to_bits(acc[i]), math::float_to_bits(widened[i])) << IsaName(isa) << " n=" << n << " shift=" << shift << " i=" << i;
          }
          Loops(isa).accumulate(acc.data(), at.data() + shift, dtype, n, /*first=*/false);
          for (uint64_t i = 0; i < n; ++i) {
            ASSERT_EQ(math::float_to_bits(acc[i]), math::float_to_bits(math::add(widened[i], widened[i])))
                << IsaName(isa) << " n=" << n << " shift=" << shift << " i=" << i;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace shardopt::cpu
