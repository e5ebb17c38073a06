// What a push sees when the backend fails under it. A backend error while a
// rank's finish folds what waited in the window (a CUDA device that failed,
// say) ends the round at once: the other ranks' pushes hear it now, not at
// the barrier's deadline, and the step pushed again goes through.
#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/store_fixture.h"

namespace shardopt {
namespace {

using ::testing::HasSubstr;
using testing::RandomBf16;
using testing::StoreTest;

// The CPU's job state, whose AccumulateGrad fails while `fail` is set.
class FailingJobState final : public JobState {
 public:
  FailingJobState(std::unique_ptr<JobState> cpu, const std::atomic<bool>* fail) : cpu_(std::move(cpu)), fail_(fail) {}

  absl::Status WriteGrad(uint32_t shard, uint32_t rank, uint64_t offset, DType dtype, const void* data,
                         uint64_t count) override {
    return cpu_->WriteGrad(shard, rank, offset, dtype, data, count);
  }
  absl::Status AccumulateGrad(uint32_t shard, uint64_t offset, DType dtype, absl::Span<const absl::string_view> runs,
                              bool first) override {
    if (fail_->load()) return absl::InternalError("injected: the device failed");
    return cpu_->AccumulateGrad(shard, offset, dtype, runs, first);
  }
  void GradBlockDone(uint32_t shard, uint64_t offset, uint64_t count) override {
    cpu_->GradBlockDone(shard, offset, count);
  }
  absl::Status WriteState(uint32_t shard, StateKind kind, uint64_t offset, DType dtype, const void* data,
                          uint64_t count) override {
    return cpu_->WriteState(shard, kind, offset, dtype, data, count);
  }
  absl::Status ReadState(uint32_t shard, StateKind kind, uint64_t offset, uint64_t count, DType dtype,
                         void* out) const override {
    return cpu_->ReadState(shard, kind, offset, count, dtype, out);
  }
  absl::StatusOr<Pieces> HoldState(uint32_t shard, StateKind kind, uint64_t offset, uint64_t count,
                                   DType dtype) const override {
    return cpu_->HoldState(shard, kind, offset, count, dtype);
  }
  absl::StatusOr<GradStats> ReduceGrads(absl::Span<const ShardGrads> shards) const override {
    return cpu_->ReduceGrads(shards);
  }
  absl::Status Apply(absl::Span<const ShardStep> steps) override { return cpu_->Apply(steps); }
  MemoryUse memory_use() const override { return cpu_->memory_use(); }
  Precision held_precision(uint32_t shard) const override { return cpu_->held_precision(shard); }

 private:
  const std::unique_ptr<JobState> cpu_;
  const std::atomic<bool>* const fail_;
};

class FailingBackend final : public Backend {
 public:
  explicit FailingBackend(const std::atomic<bool>* fail) : fail_(fail) {}
  std::string Describe() const override { return "cpu that fails on demand"; }
  absl::StatusOr<std::unique_ptr<JobState>> Allocate(const JobLayout& layout) override {
    auto cpu = cpu_->Allocate(layout);
    if (!cpu.ok()) return cpu.status();
    return std::unique_ptr<JobState>(std::make_unique<FailingJobState>(*std::move(cpu), fail_));
  }
  uint64_t HostBytes(const JobLayout& layout) const override { return cpu_->HostBytes(layout); }

 private:
  const std::unique_ptr<Backend> cpu_ = MakeCpuBackend({});
  const std::atomic<bool>* const fail_;
};

// Set before the backend that reads it exists: a static, not a member.
std::atomic<bool> fail_accumulate{false};

class BackendFailureTest : public StoreTest {
 protected:
  BackendFailureTest() : StoreTest({}, std::make_unique<FailingBackend>(&fail_accumulate)) {
    fail_accumulate = false;
  }
  ~BackendFailureTest() override { fail_accumulate = false; }
};

TEST_F(BackendFailureTest, AFinishThatCannotFoldEndsTheRoundAtOnceAndTheRetryGoesThrough) {
  constexpr uint32_t kBarrierMs = 5000;
  Create(JobRequest("f", 2, {{"w", 1000}}, v1::PRECISION_FP32, kBarrierMs));
  const std::vector<uint16_t> g1 = RandomBf16(rng_, 1000, 1.0f);

  // Rank 1's chunk waits in the window for rank 0, which has no gradient.
  v1::GradChunk head1;
  head1.set_job("f");
  head1.set_step(1);
  head1.set_rank(1);
  auto rank1 = store_.BeginPush(head1);
  ASSERT_TRUE(rank1.ok()) << rank1.status();
  ASSERT_TRUE((*rank1)->Add(head1).ok());
  v1::GradChunk chunk = Chunk("w", 0, g1.data(), g1.size());
  ASSERT_TRUE((*rank1)->Add(chunk).ok());

  // Rank 0's finish folds that chunk, and the backend fails.
  fail_accumulate = true;
  v1::GradChunk head0 = head1;
  head0.set_rank(0);
  head0.add_no_grad("w");
  auto rank0 = store_.BeginPush(head0);
  ASSERT_TRUE(rank0.ok()) << rank0.status();
  ASSERT_TRUE((*rank0)->Add(head0).ok());
  const auto finished0 = (*rank0)->Finish();
  EXPECT_EQ(finished0.status().code(), absl::StatusCode::kInternal) << finished0.status();
  EXPECT_THAT(finished0.status().message(), HasSubstr("injected"));
  fail_accumulate = false;

  // Rank 1 hears at once that the round ended, not after kBarrierMs.
  const auto t0 = std::chrono::steady_clock::now();
  const auto finished1 = (*rank1)->Finish();
  const auto waited = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(finished1.status().code(), absl::StatusCode::kDeadlineExceeded) << finished1.status();
  EXPECT_THAT(finished1.status().message(), HasSubstr("could not be summed"));
  EXPECT_LT(waited, std::chrono::milliseconds(kBarrierMs / 2));
  rank0->reset();
  rank1->reset();

  // The step pushed again is summed and applied.
  auto again1 = std::async(std::launch::async, [&] { return Push("f", 1, 1, {{"w", g1}}); });
  auto again0 = Push("f", 1, 0, {}, 1000, 0, {"w"});
  EXPECT_TRUE(again0.ok()) << again0.status();
  EXPECT_TRUE(again1.get().ok());
  EXPECT_TRUE(Commit("f", 1, 1e-3).ok());
}

}  // namespace
}  // namespace shardopt
