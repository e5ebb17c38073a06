// Bitwise parity of the CUDA backend with the CPU backend, its reference
// implementation: one layout, the same inputs to both, and every byte of
// every state compared. Skips without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/testing.h"
#include "kernels/gpu.h"
#include "kernels/step_scalars.h"
#include "tests/testing/rank_pattern.h"

namespace shardopt {
namespace {

constexpr StateKind kKinds[] = {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq, StateKind::kParamBf16};

// Nonzero values of both signs over several binades, so that a wrong, missed
// or swapped element shows.
class Values {
 public:
  explicit Values(uint64_t seed) : rng_(seed) {}
  float Signed(float scale) {
    const float x = std::uniform_real_distribution<float>(0.25f, 2.0f)(rng_) * scale;
    return rng_() & 1 ? -x : x;
  }
  float Positive(float scale) { return std::fabs(Signed(scale)); }
  uint64_t Below(uint64_t n) { return rng_() % n; }

 private:
  std::mt19937_64 rng_;
};

std::vector<uint8_t> Encode(const std::vector<float>& xs, DType dtype) {
  std::vector<uint8_t> bytes(xs.size() * DTypeSize(dtype));
  for (size_t i = 0; i < xs.size(); ++i) {
    if (dtype == DType::kFp32) {
      std::memcpy(&bytes[i * 4], &xs[i], 4);
    } else {
      const uint16_t h = math::float_to_bf16(xs[i]);
      std::memcpy(&bytes[i * 2], &h, 2);
    }
  }
  return bytes;
}

// [0, n) cut into pieces of random length, so that writes start at odd
// offsets, off any 16-byte boundary.
std::vector<std::pair<uint64_t, uint64_t>> Pieces(uint64_t n, Values& values, uint64_t max_piece) {
  std::vector<std::pair<uint64_t, uint64_t>> pieces;
  for (uint64_t at = 0; at < n;) {
    const uint64_t len = std::min(n - at, 1 + values.Below(max_piece));
    pieces.push_back({at, len});
    at += len;
  }
  return pieces;
}

using testing::RankPattern;

JobLayout Layout(const std::vector<uint64_t>& sizes, Precision precision, uint32_t world, DType grad_dtype) {
  JobLayout layout;
  for (uint64_t n : sizes) layout.shards.push_back({n, precision});
  layout.world_size = world;
  layout.grad_dtype = grad_dtype;
  return layout;
}

class CudaParityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (UsableGpuCount() == 0) GTEST_SKIP() << "no GPU: " << GpuUnavailableReason();
    auto gpu = MakeCudaBackend(0);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    gpu_ = *std::move(gpu);
    cpu_ = MakeCpuBackend();
  }

  void Allocate(const JobLayout& layout) {
    layout_ = layout;
    auto cpu = cpu_->Allocate(layout);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    auto gpu = gpu_->Allocate(layout);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    cpu_job_ = *std::move(cpu);
    gpu_job_ = *std::move(gpu);
    adam_steps_.assign(layout.shards.size(), 0);
  }

  // Random master, m and v, written in pieces, some as bf16.
  // `special` mixes in signed zeros, subnormals and huge values.
  void WriteState(Values& values, bool special = false) {
    for (uint32_t s = 0; s < layout_.shards.size(); ++s) {
      const uint64_t n = layout_.shards[s].numel;
      for (StateKind kind : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
        std::vector<float> xs(n);
        for (float& x : xs) {
          x = kind == StateKind::kMaster ? values.Signed(1.0f)
              : kind == StateKind::kExpAvg ? values.Signed(1e-2f)
                                           : values.Positive(1e-4f);
          if (special && values.Below(16) == 0) {
            const float picks[] = {0.0f, -0.0f, 1e-40f, 3e-39f, 1e30f, 1e-30f};
            x = picks[values.Below(6)];
            if (kind != StateKind::kExpAvgSq && values.Below(2) == 0) x = -x;
          }
        }
        const DType dtype = (s + static_cast<int>(kind)) % 3 == 2 ? DType::kBf16 : DType::kFp32;
        const std::vector<uint8_t> bytes = Encode(xs, dtype);
        for (auto [offset, len] : Pieces(n, values, 3001)) {
          const uint8_t* data = bytes.data() + offset * DTypeSize(dtype);
          ASSERT_TRUE(cpu_job_->WriteState(s, kind, offset, dtype, data, len).ok());
          const absl::Status st = gpu_job_->WriteState(s, kind, offset, dtype, data, len);
          ASSERT_TRUE(st.ok()) << st;
        }
      }
    }
  }

  void WriteGrads(const std::vector<ShardGrads>& grads, Values& values, float scale, bool special = false) {
    const DType dtype = layout_.grad_dtype;
    for (const ShardGrads& sg : grads) {
      const uint64_t n = layout_.shards[sg.shard].numel;
      for (uint32_t rank : sg.ranks) {
        std::vector<float> xs(n);
        for (float& x : xs) {
          x = values.Signed(scale);
          if (special && values.Below(32) == 0) {
            const float picks[] = {1e-40f, 1e-30f, 1e30f, -1e30f, 0.0f};
            x = picks[values.Below(5)];
          }
        }
        const std::vector<uint8_t> bytes = Encode(xs, dtype);
        for (auto [offset, len] : Pieces(n, values, 5003)) {
          const uint8_t* data = bytes.data() + offset * DTypeSize(dtype);
          ASSERT_TRUE(cpu_job_->WriteGrad(sg.shard, rank, offset, dtype, data, len).ok());
          const absl::Status st = gpu_job_->WriteGrad(sg.shard, rank, offset, dtype, data, len);
          ASSERT_TRUE(st.ok()) << st;
        }
      }
    }
  }

  void ExpectSameReduce(const std::vector<ShardGrads>& grads) {
    auto cpu = cpu_job_->ReduceGrads(grads);
    auto gpu = gpu_job_->ReduceGrads(grads);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    EXPECT_EQ(cpu->nonfinite, gpu->nonfinite);
    if (std::isnan(cpu->sum_squares)) {
      EXPECT_TRUE(std::isnan(gpu->sum_squares));  // NaN payloads are the hardware's
      return;
    }
    uint64_t cpu_bits, gpu_bits;
    std::memcpy(&cpu_bits, &cpu->sum_squares, 8);
    std::memcpy(&gpu_bits, &gpu->sum_squares, 8);
    EXPECT_EQ(cpu_bits, gpu_bits) << "cpu " << cpu->sum_squares << " gpu " << gpu->sum_squares;
  }

  // The GPU's bf16 params of the updated shards are poisoned first (0xFFFF,
  // a NaN no update produces from finite values), so an element the kernel
  // skipped cannot pass for one it wrote.
  void ApplyBoth(const std::vector<ShardStep>& steps) {
    for (const ShardStep& step : steps) {
      const absl::Status poisoned = cuda_testing::FillParamsOut(*gpu_job_, step.grads.shard, 0xFF);
      ASSERT_TRUE(poisoned.ok()) << poisoned;
    }
    ASSERT_TRUE(cpu_job_->Apply(steps).ok());
    const absl::Status st = gpu_job_->Apply(steps);
    ASSERT_TRUE(st.ok()) << st;
  }

  std::vector<uint8_t> Read(JobState& job, uint32_t shard, StateKind kind, uint64_t offset, uint64_t count) {
    const DType dtype = kind == StateKind::kParamBf16 ? DType::kBf16 : DType::kFp32;
    std::vector<uint8_t> out(count * DTypeSize(dtype), 0xA5);
    const absl::Status st = job.ReadState(shard, kind, offset, count, dtype, out.data());
    EXPECT_TRUE(st.ok()) << st;
    return out;
  }

  void ExpectSame(uint32_t shard, StateKind kind, uint64_t offset, uint64_t count, const std::string& when) {
    const std::vector<uint8_t> cpu = Read(*cpu_job_, shard, kind, offset, count);
    const std::vector<uint8_t> gpu = Read(*gpu_job_, shard, kind, offset, count);
    if (cpu == gpu) return;
    const uint64_t esize = cpu.size() / std::max<uint64_t>(count, 1);
    for (uint64_t i = 0; i < count; ++i) {
      if (std::memcmp(&cpu[i * esize], &gpu[i * esize], esize) != 0) {
        uint32_t c = 0, g = 0;
        std::memcpy(&c, &cpu[i * esize], esize);
        std::memcpy(&g, &gpu[i * esize], esize);
        ADD_FAILURE() << when << ": shard " << shard << " " << StateKindName(kind) << " element " << offset + i
                      << " differs: cpu 0x" << std::hex << c << " gpu 0x" << g;
        return;
      }
    }
  }

  void ExpectSameState(const std::string& when, bool params_only = false) {
    for (uint32_t s = 0; s < layout_.shards.size(); ++s) {
      for (StateKind kind : kKinds) {
        if (!params_only || kind == StateKind::kParamBf16) ExpectSame(s, kind, 0, layout_.shards[s].numel, when);
      }
    }
  }

  // Each shard's hyperparameters differ, so a scalar read from the wrong
  // task shows.
  math::AdamWScalars Scalars(uint32_t shard) {
    AdamWHyper hyper;
    hyper.weight_decay = 0.01 * (1 + shard % 3);
    hyper.lr_multiplier = 1.0 + 0.25 * (shard % 4);
    const float gscale = 0.7f / static_cast<float>(layout_.world_size);
    return ComputeAdamWScalars(hyper, 1e-3 * (1 + shard % 5), gscale, ++adam_steps_[shard]);
  }

  // Steps with fresh gradients: each step some shards have none and the
  // contributing ranks vary. The bf16 params are compared after every step,
  // everything every `full_every` steps and at the end.
  void RunSteps(int steps, Values& values, int full_every, bool special = false) {
    for (int t = 0; t < steps; ++t) {
      std::vector<ShardGrads> grads;
      for (uint32_t s = 0; s < layout_.shards.size(); ++s) {
        if ((s + t) % 7 == 3) continue;  // this tensor has no gradient this step
        grads.push_back({s, RankPattern(layout_.world_size, s + t)});
      }
      ASSERT_NO_FATAL_FAILURE(WriteGrads(grads, values, 1e-2f, special));
      ASSERT_NO_FATAL_FAILURE(ExpectSameReduce(grads));
      std::vector<ShardStep> batch;
      for (const ShardGrads& sg : grads) batch.push_back({sg, Scalars(sg.shard)});
      ASSERT_NO_FATAL_FAILURE(ApplyBoth(batch));
      const bool full = (t + 1) % full_every == 0 || t + 1 == steps;
      ExpectSameState(absl::StrCat("after step ", t + 1), !full);
      if (HasFailure()) return;
    }
  }

  std::unique_ptr<Backend> cpu_, gpu_;
  std::unique_ptr<JobState> cpu_job_, gpu_job_;
  JobLayout layout_;
  std::vector<uint64_t> adam_steps_;
};

// Sizes around every boundary: the 8-element vector, the 4096-element
// reduction block and the 16384-element chunk.
const std::vector<uint64_t> kOddSizes = {1,    2,     3,     7,     8,     9,     15,    17,   255,
                                         1000, 4095,  4096,  4097,  16383, 16384, 16385, 40013, 100003};

struct Config {
  Precision precision;
  uint32_t world;
  DType grad_dtype;
};

std::string Name(const Config& c) {
  return absl::StrCat(PrecisionName(c.precision), "_W", c.world, "_", DTypeName(c.grad_dtype), "Grads");
}
void PrintTo(const Config& c, std::ostream* os) { *os << Name(c); }

class CudaParityConfigTest : public CudaParityTest, public ::testing::WithParamInterface<Config> {};

TEST_P(CudaParityConfigTest, OddSizesAndOffsetsMatchCpu) {
  const Config c = GetParam();
  ASSERT_NO_FATAL_FAILURE(Allocate(Layout(kOddSizes, c.precision, c.world, c.grad_dtype)));
  Values values(11 + c.world);
  ASSERT_NO_FATAL_FAILURE(WriteState(values));
  ExpectSameState("after WriteState");
  RunSteps(8, values, 1);
}

TEST_P(CudaParityConfigTest, SpecialValuesMatchCpu) {
  const Config c = GetParam();
  ASSERT_NO_FATAL_FAILURE(Allocate(Layout({4099, 17, 20000}, c.precision, c.world, c.grad_dtype)));
  Values values(23);
  ASSERT_NO_FATAL_FAILURE(WriteState(values, /*special=*/true));
  ExpectSameState("after WriteState");
  RunSteps(4, values, 1, /*special=*/true);
}

TEST_P(CudaParityConfigTest, ThousandStepsMatchCpu) {
  const Config c = GetParam();
  ASSERT_NO_FATAL_FAILURE(Allocate(Layout({1, 7, 4097, 20011}, c.precision, c.world, c.grad_dtype)));
  Values values(1000);
  ASSERT_NO_FATAL_FAILURE(WriteState(values));
  RunSteps(1000, values, 100);
}

INSTANTIATE_TEST_SUITE_P(
    Configs, CudaParityConfigTest,
    ::testing::Values(Config{Precision::kFp32, 1, DType::kBf16}, Config{Precision::kFp32, 4, DType::kBf16},
                      Config{Precision::kBf16, 1, DType::kBf16}, Config{Precision::kBf16, 4, DType::kBf16},
                      Config{Precision::kFp32, 4, DType::kFp32}, Config{Precision::kBf16, 1, DType::kFp32}),
    [](const ::testing::TestParamInfo<Config>& info) { return Name(info.param); });

TEST_F(CudaParityTest, HundredsOfTensorsOfBothPrecisionsInOneApply) {
  Values values(300);
  JobLayout layout = Layout({}, Precision::kFp32, 2, DType::kBf16);
  for (int s = 0; s < 300; ++s) {
    layout.shards.push_back({1 + values.Below(3000), s % 3 == 0 ? Precision::kBf16 : Precision::kFp32});
  }
  ASSERT_NO_FATAL_FAILURE(Allocate(layout));
  ASSERT_NO_FATAL_FAILURE(WriteState(values));
  RunSteps(3, values, 1);
}

TEST_F(CudaParityTest, LargeTransfersGoThroughStagingInPieces) {
  // 3M fp32 elements are 12 MiB: three pieces of the 4 MiB staging slots.
  constexpr uint64_t kN = 3'000'017;
  ASSERT_NO_FATAL_FAILURE(Allocate(Layout({kN}, Precision::kFp32, 1, DType::kFp32)));
  Values values(3);
  std::vector<float> xs(kN);
  for (StateKind kind : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
    for (float& x : xs) x = kind == StateKind::kExpAvgSq ? values.Positive(1e-4f) : values.Signed(1e-2f);
    // One write from offset 1, then the first element on its own.
    ASSERT_TRUE(cpu_job_->WriteState(0, kind, 1, DType::kFp32, xs.data() + 1, kN - 1).ok());
    ASSERT_TRUE(gpu_job_->WriteState(0, kind, 1, DType::kFp32, xs.data() + 1, kN - 1).ok());
    ASSERT_TRUE(cpu_job_->WriteState(0, kind, 0, DType::kFp32, xs.data(), 1).ok());
    ASSERT_TRUE(gpu_job_->WriteState(0, kind, 0, DType::kFp32, xs.data(), 1).ok());
  }
  for (float& x : xs) x = values.Signed(1e-2f);
  ASSERT_TRUE(cpu_job_->WriteGrad(0, 0, 3, DType::kFp32, xs.data() + 3, kN - 3).ok());
  ASSERT_TRUE(gpu_job_->WriteGrad(0, 0, 3, DType::kFp32, xs.data() + 3, kN - 3).ok());
  ASSERT_TRUE(cpu_job_->WriteGrad(0, 0, 0, DType::kFp32, xs.data(), 3).ok());
  ASSERT_TRUE(gpu_job_->WriteGrad(0, 0, 0, DType::kFp32, xs.data(), 3).ok());
  const ShardGrads grads{0, {0}};
  ASSERT_NO_FATAL_FAILURE(ExpectSameReduce({grads}));
  std::vector<ShardStep> steps;
  steps.push_back({grads, Scalars(0)});
  ASSERT_NO_FATAL_FAILURE(ApplyBoth(steps));
  ExpectSameState("after one step");
  for (StateKind kind : kKinds) ExpectSame(0, kind, 5, kN - 12, "reading from an odd offset");
}

TEST_F(CudaParityTest, ReduceGradsMatchesCpuWithShardsListedTwice) {
  // A shard listed twice counts twice; the doubled list outgrows the job's
  // launch table and partials, so the reduction runs in several launches.
  ASSERT_NO_FATAL_FAILURE(Allocate(Layout({5000, 3, 70001, 4096}, Precision::kFp32, 3, DType::kBf16)));
  Values values(5);
  std::vector<ShardGrads> grads = {{0, {0, 1, 2}}, {1, {1}}, {2, {0, 2}}, {3, {2}}};
  ASSERT_NO_FATAL_FAILURE(WriteGrads(grads, values, 3.0f));
  const std::vector<ShardGrads> once = grads;
  grads.insert(grads.end(), once.begin(), once.end());
  grads.push_back(once[2]);
  ExpectSameReduce(grads);
  ExpectSameReduce({});
}

TEST_F(CudaParityTest, ReduceGradsFlagsNanAndInf) {
  ASSERT_NO_FATAL_FAILURE(Allocate(Layout({9000, 33}, Precision::kFp32, 2, DType::kBf16)));
  Values values(7);
  const std::vector<ShardGrads> grads = {{0, {0, 1}}, {1, {1}}};
  ASSERT_NO_FATAL_FAILURE(WriteGrads(grads, values, 1.0f));
  ExpectSameReduce(grads);
  for (const float bad : {INFINITY, NAN}) {
    const uint16_t h = math::float_to_bf16(bad);
    ASSERT_TRUE(cpu_job_->WriteGrad(0, 1, 4321, DType::kBf16, &h, 1).ok());
    ASSERT_TRUE(gpu_job_->WriteGrad(0, 1, 4321, DType::kBf16, &h, 1).ok());
    auto stats = gpu_job_->ReduceGrads(grads);
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_TRUE(stats->nonfinite);
    EXPECT_EQ(std::isnan(stats->sum_squares), std::isnan(bad));
    ExpectSameReduce(grads);
  }
}

TEST_F(CudaParityTest, StatusCodesMatchCpu) {
  ASSERT_NO_FATAL_FAILURE(Allocate(Layout({100, 10}, Precision::kBf16, 2, DType::kBf16)));
  std::vector<uint8_t> buf(1024);
  auto grads = [](uint32_t shard, std::vector<uint32_t> ranks) {
    return std::vector<ShardGrads>{{shard, std::move(ranks)}};
  };
  auto steps = [](uint32_t shard, std::vector<uint32_t> ranks) {
    return std::vector<ShardStep>{{{shard, std::move(ranks)}, {}}};
  };
  const std::vector<std::pair<std::string, std::function<absl::Status(JobState&)>>> calls = {
      {"grad shard", [&](JobState& j) { return j.WriteGrad(2, 0, 0, DType::kBf16, buf.data(), 1); }},
      {"grad rank", [&](JobState& j) { return j.WriteGrad(0, 2, 0, DType::kBf16, buf.data(), 1); }},
      {"grad range", [&](JobState& j) { return j.WriteGrad(0, 0, 95, DType::kBf16, buf.data(), 6); }},
      {"grad offset", [&](JobState& j) { return j.WriteGrad(0, 0, 101, DType::kBf16, buf.data(), 0); }},
      {"grad dtype", [&](JobState& j) { return j.WriteGrad(0, 0, 0, DType::kFp32, buf.data(), 1); }},
      {"grad empty at end", [&](JobState& j) { return j.WriteGrad(1, 1, 10, DType::kBf16, buf.data(), 0); }},
      {"write params",
       [&](JobState& j) { return j.WriteState(0, StateKind::kParamBf16, 0, DType::kBf16, buf.data(), 1); }},
      {"write range", [&](JobState& j) { return j.WriteState(1, StateKind::kExpAvg, 5, DType::kFp32, buf.data(), 6); }},
      {"read params as fp32",
       [&](JobState& j) { return j.ReadState(0, StateKind::kParamBf16, 0, 1, DType::kFp32, buf.data()); }},
      {"read state as bf16",
       [&](JobState& j) { return j.ReadState(0, StateKind::kMaster, 0, 1, DType::kBf16, buf.data()); }},
      {"read range", [&](JobState& j) { return j.ReadState(0, StateKind::kMaster, 50, 51, DType::kFp32, buf.data()); }},
      {"read shard", [&](JobState& j) { return j.ReadState(7, StateKind::kMaster, 0, 1, DType::kFp32, buf.data()); }},
      {"reduce shard", [&](JobState& j) { return j.ReduceGrads(grads(5, {0})).status(); }},
      {"reduce no rank", [&](JobState& j) { return j.ReduceGrads(grads(0, {})).status(); }},
      {"reduce order", [&](JobState& j) { return j.ReduceGrads(grads(0, {1, 0})).status(); }},
      {"reduce rank", [&](JobState& j) { return j.ReduceGrads(grads(0, {0, 2})).status(); }},
      {"apply shard", [&](JobState& j) { return j.Apply(steps(9, {0})); }},
      {"apply duplicate rank", [&](JobState& j) { return j.Apply(steps(1, {1, 1})); }},
      {"apply nothing", [&](JobState& j) { return j.Apply({}); }},
  };
  for (const auto& [name, call] : calls) {
    const absl::Status cpu = call(*cpu_job_);
    const absl::Status gpu = call(*gpu_job_);
    EXPECT_EQ(cpu.code(), gpu.code()) << name << ": cpu " << cpu << ", gpu " << gpu;
    EXPECT_EQ(cpu.message(), gpu.message()) << name;
  }
}

TEST_F(CudaParityTest, MemoryUseAndPrecisionMatchCpu) {
  JobLayout layout = Layout({1000, 77}, Precision::kFp32, 4, DType::kBf16);
  layout.shards.push_back({12345, Precision::kBf16});
  ASSERT_NO_FATAL_FAILURE(Allocate(layout));
  const MemoryUse cpu = cpu_job_->memory_use();
  const MemoryUse gpu = gpu_job_->memory_use();
  EXPECT_EQ(cpu.state_bytes, gpu.state_bytes);
  EXPECT_GE(gpu.staging_bytes, cpu.staging_bytes);  // plus alignment, the launch table and partials
  for (uint32_t s = 0; s < layout.shards.size(); ++s) {
    EXPECT_EQ(cpu_job_->held_precision(s), gpu_job_->held_precision(s));
  }
}

TEST_F(CudaParityTest, JobTooLargeIsResourceExhaustedAndHoldsNothing) {
  // The runtime's own first-use allocations (modules, launch resources)
  // happen here, not between the two measurements below.
  Values values(1);
  ASSERT_NO_FATAL_FAILURE(Allocate(Layout({1000}, Precision::kFp32, 1, DType::kBf16)));
  ASSERT_NO_FATAL_FAILURE(WriteState(values));
  ASSERT_NO_FATAL_FAILURE(RunSteps(1, values, 1));
  gpu_job_.reset();
  auto free_before = cuda_testing::FreeDeviceBytes(0);
  ASSERT_TRUE(free_before.ok()) << free_before.status();
  const std::vector<uint64_t> too_large = {
      *free_before / 16 + (uint64_t{64} << 20),  // just past free memory at 16 B per element
      uint64_t{1} << 40,                         // 16 TiB
      uint64_t{1} << 62,                         // past 2^64 bytes
  };
  for (uint64_t numel : too_large) {
    auto job = gpu_->Allocate(Layout({1000, numel}, Precision::kFp32, 1, DType::kBf16));
    ASSERT_FALSE(job.ok()) << numel;
    EXPECT_EQ(job.status().code(), absl::StatusCode::kResourceExhausted) << job.status();
    EXPECT_FALSE(job.status().message().empty());
  }
  auto free_after = cuda_testing::FreeDeviceBytes(0);
  ASSERT_TRUE(free_after.ok()) << free_after.status();
  EXPECT_EQ(*free_before, *free_after);
  EXPECT_TRUE(CudaBackendHealth(*gpu_).ok());
  auto job = gpu_->Allocate(Layout({1000}, Precision::kFp32, 1, DType::kBf16));
  EXPECT_TRUE(job.ok()) << job.status();
}

}  // namespace
}  // namespace shardopt
