// The CUDA kernels without a GPU: the device's launch plans (ArenaPlan) run
// through the kernels' own source under the host emulation, against the CPU
// backend, bitwise: every byte of every state after every step, and the bits
// of the sum of squares. What this cannot see (device memory, streams, the
// device compiler's arithmetic) is the `gpu` tests' job.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <ostream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/kernel_args.h"
#include "tests/testing/rank_pattern.h"
#include "kernels/cuda/launch_plan.h"
#include "kernels/step_scalars.h"
#include "tests/cuda_emulation/emulated_job.h"

namespace shardopt {
namespace {

using cuda::kChunk;
using cuda::kReduceUnit;
using testing::EmulatedCudaJob;

constexpr StateKind kKinds[] = {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq, StateKind::kParamBf16};

// Shard lengths that end the update's loops in every way: inside the first
// vector, on it, one past it, one short of a chunk, on it, one past it, and
// several chunks plus a tail.
const std::vector<uint64_t> kUpdateSizes = {1, 7, 8, 9, kChunk - 1, kChunk, kChunk + 1, 3 * kChunk + 9};
// The same for the reduction, whose unit is a block of the sum-of-squares
// tree, strided over kThreads lanes.
const std::vector<uint64_t> kReduceSizes = {1,  cuda::kThreads - 1, cuda::kThreads, cuda::kThreads + 1,
                                            kReduceUnit - 1, kReduceUnit, kReduceUnit + 1, 3 * kReduceUnit + 100};

// Nonzero values of both signs over several binades, so that a wrong, missed
// or swapped element shows.
class Values {
 public:
  explicit Values(uint64_t seed) : rng_(seed) {}
  float Signed(float scale) {
    const float x = std::ldexp(std::uniform_real_distribution<float>(1.0f, 2.0f)(rng_), Below(9) - 4) * scale;
    return rng_() & 1 ? -x : x;
  }
  float Positive(float scale) { return std::fabs(Signed(scale)); }
  int Below(int n) { return static_cast<int>(rng_() % static_cast<uint64_t>(n)); }

 private:
  std::mt19937_64 rng_;
};

using testing::RankPattern;

// Values as bf16 (rounded) or fp32 bytes: how a shard stores its state and a
// job its gradients.
std::vector<uint8_t> Stored(const std::vector<float>& xs, bool bf16) {
  std::vector<uint8_t> bytes(xs.size() * (bf16 ? 2 : 4));
  for (size_t i = 0; i < xs.size(); ++i) {
    if (bf16) {
      const uint16_t h = math::float_to_bf16(xs[i]);
      std::memcpy(&bytes[i * 2], &h, 2);
    } else {
      std::memcpy(&bytes[i * 4], &xs[i], 4);
    }
  }
  return bytes;
}

struct Case {
  DType grad_dtype;
  uint32_t world;
};
std::string CaseName(const Case& c) { return absl::StrCat(DTypeName(c.grad_dtype), "_grads_world", c.world); }
void PrintTo(const Case& c, std::ostream* os) { *os << CaseName(c); }

class CudaEmulationTest : public ::testing::TestWithParam<Case> {
 protected:
  CudaEmulationTest() : seed_(std::random_device{}()), values_(seed_) {}

  // Every size twice, FP32 and BF16 interleaved, so each launch's tasks and
  // each precision's launches mix tensors of every size.
  void Create(const std::vector<uint64_t>& sizes, uint64_t slot_bytes = cuda::kStagingSlotBytes) {
    layout_ = JobLayout{};
    for (const uint64_t n : sizes) {
      layout_.shards.push_back({n, Precision::kFp32});
      layout_.shards.push_back({n, Precision::kBf16});
    }
    layout_.grad_dtype = GetParam().grad_dtype;
    layout_.world_size = GetParam().world;
    auto cpu = cpu_backend_->Allocate(layout_);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    cpu_ = *std::move(cpu);
    auto emu = EmulatedCudaJob::Create(layout_, slot_bytes);
    ASSERT_TRUE(emu.ok()) << emu.status();
    emu_ = *std::move(emu);
    adam_steps_.assign(layout_.shards.size(), 0);
  }

  uint32_t shard_count() const { return static_cast<uint32_t>(layout_.shards.size()); }
  bool bf16(uint32_t shard) const { return layout_.shards[shard].precision == Precision::kBf16; }

  // The CPU job's state as the device stores it.
  std::vector<uint8_t> CpuStored(uint32_t shard, StateKind kind) {
    const uint64_t n = layout_.shards[shard].numel;
    if (kind == StateKind::kParamBf16) {
      std::vector<uint8_t> out(n * 2);
      EXPECT_TRUE(cpu_->ReadState(shard, kind, 0, n, DType::kBf16, out.data()).ok());
      return out;
    }
    std::vector<float> xs(n);
    EXPECT_TRUE(cpu_->ReadState(shard, kind, 0, n, DType::kFp32, xs.data()).ok());
    return Stored(xs, bf16(shard));  // exact: a BF16 shard's values are bf16
  }

  // Random master, m and v into the CPU job, then all of its state, params
  // included, into the arena.
  void FillState() {
    for (uint32_t s = 0; s < shard_count(); ++s) {
      for (const StateKind kind : {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq}) {
        std::vector<float> xs(layout_.shards[s].numel);
        for (float& x : xs) {
          x = kind == StateKind::kMaster   ? values_.Signed(1.0f)
              : kind == StateKind::kExpAvg ? values_.Signed(1e-2f)
                                           : values_.Positive(1e-4f);
        }
        ASSERT_TRUE(cpu_->WriteState(s, kind, 0, DType::kFp32, xs.data(), xs.size()).ok());
      }
      for (const StateKind kind : kKinds) emu_->Put(s, kind, CpuStored(s, kind));
    }
  }

  // Fresh gradients of every listed rank, the same bytes into both jobs.
  void FillGrads(const std::vector<ShardGrads>& grads, float scale = 1e-2f) {
    for (const ShardGrads& sg : grads) {
      const uint64_t n = layout_.shards[sg.shard].numel;
      for (const uint32_t rank : sg.ranks) {
        std::vector<float> xs(n);
        for (float& x : xs) x = values_.Signed(scale);
        const std::vector<uint8_t> bytes = Stored(xs, layout_.grad_dtype == DType::kBf16);
        ASSERT_TRUE(cpu_->WriteGrad(sg.shard, rank, 0, layout_.grad_dtype, bytes.data(), n).ok());
        emu_->PutGrad(sg.shard, rank, bytes);
      }
    }
  }

  // Each tensor's own scalars: hyperparameters differ by shard, the Adam
  // step counts by how often each shard was stepped, gscale by its ranks.
  ShardStep Step(uint32_t shard, std::vector<uint32_t> ranks, double lr, uint64_t offset = 0, uint64_t length = 0) {
    const AdamWHyper hyper{shard % 2 ? 0.8 : 0.9, shard % 3 ? 0.999 : 0.95, shard % 4 ? 1e-8f : 1e-6f,
                           shard % 5 ? 0.01 : 0.0, 1.0};
    ShardStep step;
    step.scalars = ComputeAdamWScalars(hyper, lr, 0.75f / static_cast<float>(ranks.size()), adam_steps_[shard] + 1);
    step.grads = {shard, std::move(ranks)};
    step.offset = offset;
    step.length = length;
    return step;
  }

  // One Apply on both, the arena's params of the updated ranges poisoned
  // first, then every byte of every shard compared.
  void ApplyBoth(const std::vector<ShardStep>& steps) {
    std::vector<ShardGrads> grads;
    for (const ShardStep& step : steps) {
      if (grads.empty() || grads.back().shard != step.grads.shard) grads.push_back(step.grads);
    }
    FillGrads(grads);
    std::vector<bool> stepped(shard_count(), false);
    for (const ShardStep& step : steps) {
      const uint64_t n = layout_.shards[step.grads.shard].numel;
      emu_->PoisonParams(step.grads.shard, step.offset, step.length == 0 ? n : step.offset + step.length);
      stepped[step.grads.shard] = true;
    }
    for (uint32_t s = 0; s < shard_count(); ++s) adam_steps_[s] += stepped[s];
    ASSERT_TRUE(cpu_->Apply(steps).ok());
    const absl::Status st = emu_->Apply(steps);
    ASSERT_TRUE(st.ok()) << st;
    ExpectSameState();
  }

  void ExpectSameState() {
    for (uint32_t s = 0; s < shard_count(); ++s) {
      for (const StateKind kind : kKinds) {
        const std::vector<uint8_t> cpu = CpuStored(s, kind);
        const std::vector<uint8_t> emu = emu_->Get(s, kind);
        ASSERT_EQ(cpu.size(), emu.size());
        const size_t elem = kind == StateKind::kParamBf16 || bf16(s) ? 2 : 4;
        for (size_t i = 0; i < cpu.size(); i += elem) {
          if (std::memcmp(&cpu[i], &emu[i], elem) != 0) {
            uint32_t c = 0, e = 0;
            std::memcpy(&c, &cpu[i], elem);
            std::memcpy(&e, &emu[i], elem);
            FAIL() << "shard " << s << " (" << layout_.shards[s].numel << " elements, "
                   << PrecisionName(layout_.shards[s].precision) << ") " << StateKindName(kind) << " element "
                   << i / elem << ": cpu 0x" << std::hex << c << ", emulated 0x" << e << std::dec << " (seed "
                   << seed_ << ")";
          }
        }
      }
    }
  }

  void ExpectSameReduce(const std::vector<ShardGrads>& grads) {
    auto cpu = cpu_->ReduceGrads(grads);
    auto emu = emu_->ReduceGrads(grads);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    ASSERT_TRUE(emu.ok()) << emu.status();
    EXPECT_EQ(cpu->nonfinite, emu->nonfinite);
    uint64_t cpu_bits, emu_bits;
    std::memcpy(&cpu_bits, &cpu->sum_squares, 8);
    std::memcpy(&emu_bits, &emu->sum_squares, 8);
    EXPECT_EQ(cpu_bits, emu_bits) << "cpu " << cpu->sum_squares << ", emulated " << emu->sum_squares << " (seed "
                                  << seed_ << ")";
  }

  // Every shard with the rank pattern of its turn, in the order given.
  std::vector<ShardGrads> AllShards(uint64_t turn, bool reversed) {
    std::vector<ShardGrads> grads;
    for (uint32_t i = 0; i < shard_count(); ++i) {
      const uint32_t s = reversed ? shard_count() - 1 - i : i;
      grads.push_back({s, RankPattern(layout_.world_size, turn + s)});
    }
    return grads;
  }

  // Three steps: every shard whole; ranges of the large shards that end at
  // every tail, with the small shards half absent, in reverse shard order;
  // every shard whole again.
  void RunSteps() {
    std::vector<ShardStep> steps;
    for (const ShardGrads& g : AllShards(0, false)) steps.push_back(Step(g.shard, g.ranks, 1e-3));
    ASSERT_NO_FATAL_FAILURE(ApplyBoth(steps));

    steps.clear();
    for (uint32_t i = 0; i < shard_count(); ++i) {
      const uint32_t s = shard_count() - 1 - i;
      const uint64_t n = layout_.shards[s].numel;
      const std::vector<uint32_t> ranks = RankPattern(layout_.world_size, s + 1);
      if (n <= kChunk) {
        if (s % 4 < 2) steps.push_back(Step(s, ranks, 2e-3));
        continue;
      }
      // Offsets are multiples of kApplyAlignment, which is kChunk.
      for (const auto& [offset, length] : std::vector<std::pair<uint64_t, uint64_t>>{
               {0, 9}, {kChunk, 7}, {2 * kChunk, kChunk - 1}, {3 * kChunk, 0}}) {
        if (offset < n && offset + length <= n) steps.push_back(Step(s, ranks, 2e-3, offset, length));
      }
    }
    ASSERT_NO_FATAL_FAILURE(ApplyBoth(steps));

    steps.clear();
    for (const ShardGrads& g : AllShards(2, false)) steps.push_back(Step(g.shard, g.ranks, 5e-4));
    ASSERT_NO_FATAL_FAILURE(ApplyBoth(steps));
  }

  const uint64_t seed_;  // fresh each run, printed with any difference
  Values values_;
  std::unique_ptr<Backend> cpu_backend_ = MakeCpuBackend({2});
  JobLayout layout_;
  std::unique_ptr<JobState> cpu_;
  std::unique_ptr<EmulatedCudaJob> emu_;
  std::vector<uint64_t> adam_steps_;
};

TEST_P(CudaEmulationTest, UpdateMatchesCpuAtEveryTail) {
  ASSERT_NO_FATAL_FAILURE(Create(kUpdateSizes));
  ASSERT_NO_FATAL_FAILURE(FillState());
  RunSteps();
}

TEST_P(CudaEmulationTest, ReductionTreeMatchesCpu) {
  ASSERT_NO_FATAL_FAILURE(Create(kReduceSizes));
  for (uint64_t turn = 0; turn < 4; ++turn) {
    const std::vector<ShardGrads> grads = AllShards(turn, turn % 2 == 1);
    ASSERT_NO_FATAL_FAILURE(FillGrads(grads, turn < 2 ? 1e-2f : 1e30f));
    ExpectSameReduce(grads);
    // Fewer shards than the job has, out of order.
    ExpectSameReduce(std::vector<ShardGrads>(grads.begin() + 3, grads.end()));
  }
}

TEST_P(CudaEmulationTest, ReductionFlagsNonfiniteLikeCpu) {
  ASSERT_NO_FATAL_FAILURE(Create(kReduceSizes));
  const std::vector<ShardGrads> grads = AllShards(0, false);
  ASSERT_NO_FATAL_FAILURE(FillGrads(grads));
  const ShardGrads& last = grads.back();
  const uint64_t n = layout_.shards[last.shard].numel;
  std::vector<float> xs(n);
  for (float& x : xs) x = values_.Signed(1e-2f);
  xs[n - 1] = INFINITY;
  const std::vector<uint8_t> bytes = Stored(xs, layout_.grad_dtype == DType::kBf16);
  ASSERT_TRUE(cpu_->WriteGrad(last.shard, last.ranks.back(), 0, layout_.grad_dtype, bytes.data(), n).ok());
  emu_->PutGrad(last.shard, last.ranks.back(), bytes);
  ExpectSameReduce(grads);
  EXPECT_TRUE(emu_->ReduceGrads(grads)->nonfinite);
}

// A staging slot so small that a launch's table holds one task and its
// partials 16 reduction blocks: the plan splits the work into a launch per
// task, and the large shards' reductions across launches.
TEST_P(CudaEmulationTest, SplitLaunchesMatchCpu) {
  constexpr uint64_t kSmallSlot = 128;
  std::vector<uint64_t> sizes = kUpdateSizes;
  sizes.push_back(20 * kReduceUnit + 5);
  ASSERT_NO_FATAL_FAILURE(Create(sizes, kSmallSlot));
  ASSERT_NO_FATAL_FAILURE(FillState());
  const int before_steps = emu_->launches();
  RunSteps();
  EXPECT_GE(emu_->launches() - before_steps, static_cast<int>(3 * shard_count() / 2));
  const std::vector<ShardGrads> grads = AllShards(1, true);
  ASSERT_NO_FATAL_FAILURE(FillGrads(grads));
  const int before_reduce = emu_->launches();
  ExpectSameReduce(grads);
  // One launch per shard, and one more for each large shard's last 5 blocks.
  EXPECT_EQ(emu_->launches() - before_reduce, static_cast<int>(shard_count() + 2));
}

INSTANTIATE_TEST_SUITE_P(GradsAndRanks, CudaEmulationTest,
                         ::testing::Values(Case{DType::kBf16, 1}, Case{DType::kBf16, 2}, Case{DType::kBf16, 4},
                                           Case{DType::kFp32, 1}, Case{DType::kFp32, 2}, Case{DType::kFp32, 4}),
                         [](const ::testing::TestParamInfo<Case>& info) { return CaseName(info.param); });

}  // namespace
}  // namespace shardopt
