// What a push sees when the backend fails under it. A backend error while a
// rank's finish folds what waited in the window, or while the last rank's
// finish takes the gradients' norm (a CUDA device that failed, say), ends
// the round at once: the other ranks' pushes hear it now, not at the
// barrier's deadline, and the step pushed again goes through.
#include <atomic>
#include <chrono>
#include <future>
#include <thread>
#include <memory>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/store_fixture.h"
#include "tests/testing/wrapped_cpu_backend.h"

namespace shardopt {
namespace {

using ::testing::HasSubstr;
using testing::RandomBf16;
using testing::StoreTest;

// Set while the CPU's AccumulateGrad (ReduceGrads) is to fail. Set before
// the backend that reads them exists: statics, not members.
std::atomic<bool> fail_accumulate{false};
std::atomic<bool> fail_reduce{false};

class FailingJobState final : public testing::ForwardingJobState {
 public:
  using ForwardingJobState::ForwardingJobState;
  absl::Status AccumulateGrad(uint32_t shard, uint64_t offset, DType dtype, absl::Span<const absl::string_view> runs,
                              bool first) override {
    if (fail_accumulate.load()) return absl::InternalError("injected: the device failed");
    return ForwardingJobState::AccumulateGrad(shard, offset, dtype, runs, first);
  }
  absl::StatusOr<GradStats> ReduceGrads(absl::Span<const ShardGrads> shards) const override {
    if (fail_reduce.load()) return absl::InternalError("injected: the device failed");
    return ForwardingJobState::ReduceGrads(shards);
  }
};

class BackendFailureTest : public StoreTest {
 protected:
  BackendFailureTest()
      : StoreTest({}, std::make_unique<testing::WrappedCpuBackend>(
                          "cpu that fails on demand", [](std::unique_ptr<JobState> cpu) -> std::unique_ptr<JobState> {
                            return std::make_unique<FailingJobState>(std::move(cpu));
                          })) {
    fail_accumulate = false;
    fail_reduce = false;
  }
  ~BackendFailureTest() override {
    fail_accumulate = false;
    fail_reduce = false;
  }
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

TEST_F(BackendFailureTest, ASealThatCannotTakeTheNormEndsTheRoundAtOnceAndTheRetryGoesThrough) {
  constexpr uint32_t kBarrierMs = 5000;
  Create(JobRequest("n", 2, {{"w", 1000}}, v1::PRECISION_FP32, kBarrierMs));
  const std::vector<uint16_t> g0 = RandomBf16(rng_, 1000, 1.0f), g1 = RandomBf16(rng_, 1000, 1.0f);

  // Rank 1 pushes and waits at the barrier; rank 0's finish, the last,
  // seals, and the backend fails to take the norm.
  auto waiting = std::async(std::launch::async, [&] { return Push("n", 1, 1, {{"w", g1}}); });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // rank 1 is in
  fail_reduce = true;
  const auto t0 = std::chrono::steady_clock::now();
  const auto sealed = Push("n", 1, 0, {{"w", g0}});
  fail_reduce = false;
  EXPECT_EQ(sealed.status().code(), absl::StatusCode::kInternal) << sealed.status();
  EXPECT_THAT(sealed.status().message(), HasSubstr("injected"));

  // Rank 1 hears at once that the round ended, not after kBarrierMs.
  const auto heard = waiting.get();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(kBarrierMs / 2));
  EXPECT_EQ(heard.status().code(), absl::StatusCode::kDeadlineExceeded) << heard.status();
  EXPECT_THAT(heard.status().message(), HasSubstr("norm could not be taken"));

  // The step pushed again is summed and applied.
  auto again1 = std::async(std::launch::async, [&] { return Push("n", 1, 1, {{"w", g1}}); });
  auto again0 = Push("n", 1, 0, {{"w", g0}});
  EXPECT_TRUE(again0.ok()) << again0.status();
  EXPECT_TRUE(again1.get().ok());
  EXPECT_TRUE(Commit("n", 1, 1e-3).ok());
}

}  // namespace
}  // namespace shardopt
