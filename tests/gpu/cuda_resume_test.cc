// Bit-exact resume on the CUDA backend, at the seam a checkpoint uses: N
// steps; the state read out as JobStore's snapshot reads it (fp32, exact for
// both precisions); a freshly allocated job given that state as restore gives
// it (fp32 for FP32 shards, the top halves as bf16 for BF16 shards); N more
// steps. Every byte of master, m, v and the bf16 params must equal 2N
// uninterrupted steps. It needs no gRPC, so it builds for the device machine.
// Skips without a GPU.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "kernels/adamw_math.h"
#include "kernels/gpu.h"
#include "kernels/step_scalars.h"

namespace shardopt {
namespace {

constexpr uint64_t kSteps = 10;
constexpr StateKind kState[] = {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq};

JobLayout Layout() {
  JobLayout layout;
  layout.shards = {{5003, Precision::kFp32}, {3001, Precision::kBf16}};
  return layout;
}

void Init(JobState& job, const JobLayout& layout) {
  for (uint32_t s = 0; s < layout.shards.size(); ++s) {
    std::mt19937_64 rng(s + 1);
    std::vector<float> xs(layout.shards[s].numel);
    for (float& x : xs) x = std::uniform_real_distribution<float>(-1, 1)(rng);
    ASSERT_TRUE(job.WriteState(s, StateKind::kMaster, 0, DType::kFp32, xs.data(), xs.size()).ok());
  }
}

// Steps from+1 .. to; the gradients are a function of the step alone.
void Steps(JobState& job, const JobLayout& layout, uint64_t from, uint64_t to) {
  for (uint64_t t = from + 1; t <= to; ++t) {
    std::vector<ShardStep> steps;
    for (uint32_t s = 0; s < layout.shards.size(); ++s) {
      std::mt19937_64 rng(t * 131 + s);
      std::vector<uint16_t> g(layout.shards[s].numel);
      for (uint16_t& x : g) x = math::float_to_bf16(std::normal_distribution<float>(0, 0.3f)(rng));
      ASSERT_TRUE(job.WriteGrad(s, 0, 0, DType::kBf16, g.data(), g.size()).ok());
      steps.push_back({{s, {0}}, ComputeAdamWScalars(AdamWHyper{}, 1e-2, 1.0f, t)});
    }
    const absl::Status st = job.Apply(steps);
    ASSERT_TRUE(st.ok()) << st;
  }
}

// Every byte of the state as fp32, and the params as bf16.
std::vector<uint8_t> Bytes(const JobState& job, const JobLayout& layout) {
  std::vector<uint8_t> out;
  for (uint32_t s = 0; s < layout.shards.size(); ++s) {
    const uint64_t n = layout.shards[s].numel;
    std::vector<uint8_t> buf(n * 4);
    for (StateKind k : kState) {
      EXPECT_TRUE(job.ReadState(s, k, 0, n, DType::kFp32, buf.data()).ok());
      out.insert(out.end(), buf.begin(), buf.end());
    }
    EXPECT_TRUE(job.ReadState(s, StateKind::kParamBf16, 0, n, DType::kBf16, buf.data()).ok());
    out.insert(out.end(), buf.begin(), buf.begin() + n * 2);
  }
  return out;
}

TEST(CudaResumeTest, SnapshotRestoreAndResumeIsBitwiseEqualToAnUninterruptedRun) {
  if (UsableGpuCount() == 0) GTEST_SKIP() << "no GPU: " << GpuUnavailableReason();
  auto backend = MakeCudaBackend(0);
  ASSERT_TRUE(backend.ok()) << backend.status();
  const JobLayout layout = Layout();

  auto whole = (*backend)->Allocate(layout);
  ASSERT_TRUE(whole.ok()) << whole.status();
  Init(**whole, layout);
  Steps(**whole, layout, 0, kSteps);
  const std::vector<uint8_t> at_n = Bytes(**whole, layout);
  Steps(**whole, layout, kSteps, 2 * kSteps);

  auto first = (*backend)->Allocate(layout);
  ASSERT_TRUE(first.ok()) << first.status();
  Init(**first, layout);
  Steps(**first, layout, 0, kSteps);
  auto second = (*backend)->Allocate(layout);
  ASSERT_TRUE(second.ok()) << second.status();
  for (uint32_t s = 0; s < layout.shards.size(); ++s) {
    const uint64_t n = layout.shards[s].numel;
    std::vector<float> xs(n);
    for (StateKind k : kState) {
      ASSERT_TRUE((*first)->ReadState(s, k, 0, n, DType::kFp32, xs.data()).ok());
      if (layout.shards[s].precision == Precision::kFp32) {
        ASSERT_TRUE((*second)->WriteState(s, k, 0, DType::kFp32, xs.data(), n).ok());
        continue;
      }
      std::vector<uint16_t> hs(n);
      for (uint64_t i = 0; i < n; ++i) {
        uint32_t u;
        std::memcpy(&u, &xs[i], 4);
        ASSERT_EQ(u & 0xFFFF, 0u) << "a BF16 shard's state read as fp32 must be exact";
        hs[i] = static_cast<uint16_t>(u >> 16);
      }
      ASSERT_TRUE((*second)->WriteState(s, k, 0, DType::kBf16, hs.data(), n).ok());
    }
  }
  first->reset();
  EXPECT_EQ(Bytes(**second, layout), at_n) << "the restored state differs from the one read out";
  Steps(**second, layout, kSteps, 2 * kSteps);
  EXPECT_EQ(Bytes(**second, layout), Bytes(**whole, layout));
}

}  // namespace
}  // namespace shardopt
