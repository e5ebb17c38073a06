// The node group's NCCL collective on real GPUs (label gpu: skips without
// one). One rank on one GPU always; every GPU of the machine, one rank each,
// when there are two or more.
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "shardopt/nccl_collective.h"

namespace shardopt {
namespace {

int Gpus() {
  auto n = CudaDeviceCount();
  return n.ok() ? *n : 0;
}

// bf16 small integers, positive and negative: their fp32 sums are exact in
// any order, so NCCL's order of addition cannot hide behind rounding.
std::vector<uint16_t> SmallIntegers(uint64_t n, uint32_t salt) {
  std::vector<uint16_t> out(n);
  for (uint64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(static_cast<int>((i * 2654435761u + salt * 40503u) % 255) - 127);
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    out[i] = static_cast<uint16_t>(bits >> 16);
  }
  return out;
}

float Widen(uint16_t b) {
  const uint32_t bits = uint32_t{b} << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Runs the three collectives of a node group step as `size` ranks, one per
// GPU, and checks each rank's results against sums computed on the host.
void RunRanks(uint32_t size) {
  constexpr uint64_t kElements = 3 * 4096 + 17;
  auto id = NewNcclId();
  ASSERT_TRUE(id.ok()) << id.status();
  std::vector<FlatRange> ranges;
  for (uint32_t r = 0; r < size; ++r) ranges.push_back({kElements * r / size, kElements * (r + 1) / size});
  std::vector<std::string> failures(size);
  std::vector<std::thread> threads;
  for (uint32_t rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      auto fail = [&](const std::string& what) { failures[rank] += what + "; "; };
      auto collective = MakeNcclCollective(*id, rank, size, static_cast<int>(rank));
      if (!collective.ok()) return fail(collective.status().ToString());
      auto grads = DeviceBuffer::Allocate(kElements * 2, static_cast<int>(rank));
      if (!grads.ok()) return fail(grads.status().ToString());
      const auto host = SmallIntegers(kElements, rank);
      if (!grads->CopyFromHost(host.data(), kElements * 2).ok()) return fail("copy");
      const FlatRange mine = ranges[rank];
      std::vector<float> sums(mine.size());
      if (auto st = (*collective)->ReduceScatter(static_cast<uint16_t*>(grads->data()), sums.data(), ranges); !st.ok()) {
        return fail(st.ToString());
      }
      for (uint64_t i = mine.begin; i < mine.end; ++i) {
        float expected = 0;
        for (uint32_t r = 0; r < size; ++r) expected += Widen(SmallIntegers(kElements, r)[i]);
        if (sums[i - mine.begin] != expected) return fail("reduce-scatter sum differs at " + std::to_string(i));
      }
      // All-gather: each rank fills only its own range with its params.
      auto params = DeviceBuffer::Allocate(kElements * 2, static_cast<int>(rank));
      if (!params.ok()) return fail(params.status().ToString());
      std::vector<uint16_t> mine_params(host.begin() + mine.begin, host.begin() + mine.end);
      if (auto st = (*collective)->FromHost(mine_params.data(), static_cast<uint16_t*>(params->data()) + mine.begin,
                                            mine.size() * 2);
          !st.ok()) {
        return fail(st.ToString());
      }
      if (auto st = (*collective)->AllGather(static_cast<uint16_t*>(params->data()), ranges); !st.ok()) {
        return fail(st.ToString());
      }
      std::vector<uint16_t> gathered(kElements);
      if (!params->CopyToHost(gathered.data(), kElements * 2).ok()) return fail("copy back");
      for (uint32_t r = 0; r < size; ++r) {
        const auto owner = SmallIntegers(kElements, r);
        for (uint64_t i = ranges[r].begin; i < ranges[r].end; ++i) {
          if (gathered[i] != owner[i]) return fail("all-gather differs at " + std::to_string(i));
        }
      }
      std::vector<double> partials = {rank == 0 ? 1.5 : 0.0, static_cast<double>(rank)};
      if (auto st = (*collective)->AllReduceSum(partials.data(), partials.size()); !st.ok()) return fail(st.ToString());
      if (partials[0] != 1.5 || partials[1] != size * (size - 1) / 2.0) fail("all-reduce sum");
    });
  }
  for (auto& t : threads) t.join();
  for (uint32_t r = 0; r < size; ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

TEST(NcclCollective, OneRankOnOneGpu) {
  if (Gpus() < 1) GTEST_SKIP() << "no GPU";
  RunRanks(1);
}

TEST(NcclCollective, OneRankPerGpuOfTheMachine) {
  const int gpus = Gpus();
  if (gpus < 2) GTEST_SKIP() << "fewer than two GPUs: NCCL across GPUs is not exercised here";
  RunRanks(static_cast<uint32_t>(gpus));
}

}  // namespace
}  // namespace shardopt
