// A checkpoint streams the job's state to disk without copying it first
// (the writer's few buffers are direct_io_test's), and nothing writes the
// state until the stream is through, so the part holds exactly the step it
// names.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <filesystem>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "server/job_store.h"
#include "tests/testing/checkpoint_dir_fixture.h"
#include "tests/testing/reference.h"
#include "tests/testing/wrapped_cpu_backend.h"

namespace shardopt {
namespace {

using testing::CheckpointDirTest;
using testing::RandomBf16;
using testing::RandomFloats;

// What the wrapped CPU state saw: the snapshot's slices, counted as it
// locates them (HostFp32State), and any write of the state made between
// its first slice and its last. After the second slice each one sleeps,
// under the job's lock, so that the stream lasts long enough (22 slices of
// 10 ms) for a writer started then to come in if it could, and for a
// caller that must not wait to be turned back while it streams.
struct StreamProbe {
  int total = 0;  // slices in one snapshot of the job
  std::atomic<int> slices{0};
  std::atomic<int> writes_mid_stream{0};
  absl::Notification second_slice;
};

class ProbedJobState final : public testing::ForwardingJobState {
 public:
  ProbedJobState(std::unique_ptr<JobState> cpu, StreamProbe* probe)
      : ForwardingJobState(std::move(cpu)), probe_(probe) {}
  char* HostFp32State(uint32_t shard, StateKind kind) override {
    const int n = ++probe_->slices;
    if (n == 2) probe_->second_slice.Notify();
    if (n >= 2) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return ForwardingJobState::HostFp32State(shard, kind);
  }
  absl::Status WriteState(uint32_t shard, StateKind kind, uint64_t offset, DType dtype, const void* data,
                          uint64_t count) override {
    NoteWrite();
    return ForwardingJobState::WriteState(shard, kind, offset, dtype, data, count);
  }
  absl::Status Apply(absl::Span<const ShardStep> steps) override {
    NoteWrite();
    return ForwardingJobState::Apply(steps);
  }

 private:
  void NoteWrite() {
    const int n = probe_->slices;
    if (n > 0 && n < probe_->total) ++probe_->writes_mid_stream;
  }
  StreamProbe* const probe_;
};

class StreamHoldsOffWritersTest : public CheckpointDirTest<0> {
 protected:
  // 2^21 elements: 8 slices of 2^18 per array, master, m and v.
  static constexpr uint64_t kNumel = uint64_t{1} << 21;

  StreamHoldsOffWritersTest()
      : CheckpointDirTest<0>(std::make_unique<testing::WrappedCpuBackend>(
            MakeCpuBackend({})->Describe(), [this](std::unique_ptr<JobState> s) {
              return std::unique_ptr<JobState>(std::make_unique<ProbedJobState>(std::move(s), &probe_));
            })) {
    probe_.total = 3 * static_cast<int>(kNumel >> 18);
  }

  // Checkpoints step `step` on a thread of its own, runs `writer` once the
  // stream is under way, and checks that the part holds the state as it
  // was before `writer`, bitwise, and that nothing wrote the state midway.
  void CheckpointWhile(uint64_t step, const std::function<void()>& writer) {
    const std::string before = Snapshot("j");
    v1::CheckpointRequest request;
    request.set_job("j");
    request.set_step(step);
    absl::StatusOr<v1::CheckpointResponse> written;
    std::thread checkpoint([&] { written = store_.Checkpoint(request); });
    probe_.second_slice.WaitForNotification();
    writer();
    checkpoint.join();
    ASSERT_TRUE(written.ok()) << written.status();
    EXPECT_EQ(probe_.slices.load(), probe_.total);
    EXPECT_EQ(probe_.writes_mid_stream.load(), 0);

    auto backend = MakeCpuBackend({});
    JobStore fresh(backend.get(), Options0(dir_));
    auto restored = fresh.CreateJob(request_);
    ASSERT_TRUE(restored.ok()) << restored.status();
    ASSERT_TRUE(restored->restored());
    EXPECT_EQ(restored->step(), step);
    EXPECT_TRUE(Snapshot(fresh, "j") == before);  // not EXPECT_EQ: gtest would diff 30 MB strings
  }

  StreamProbe probe_;
  v1::CreateJobRequest request_ = JobRequest("j", 1, {{"w", kNumel}});
};

// The next step's push goes on while a checkpoint of step 1 streams; its
// commit waits, then applies, and the part is step 1's.
TEST_F(StreamHoldsOffWritersTest, TheNextStepsApplyWaitsForTheStream) {
  Create(request_);
  std::mt19937_64 rng(3);
  ASSERT_TRUE(Push("j", 1, 0, {{"w", RandomBf16(rng, kNumel, 0.5f)}}).ok());
  ASSERT_TRUE(Commit("j", 1, 1e-2).ok());
  const auto grad = RandomBf16(rng, kNumel, 0.5f);
  CheckpointWhile(1, [&] {
    ASSERT_TRUE(Push("j", 2, 0, {{"w", grad}}, 1 << 16).ok());
    auto committed = Commit("j", 2, 1e-2);
    ASSERT_TRUE(committed.ok()) << committed.status();
  });
  EXPECT_EQ(store_.Describe("j")->step(), 2u);
}

// Init at step 0 (as a load_state_dict after the first checkpoint) waits
// for the stream too.
TEST_F(StreamHoldsOffWritersTest, InitWaitsForTheStream) {
  Create(request_);
  const std::vector<float> other = RandomFloats(rng_, kNumel, -1, 1);
  CheckpointWhile(0, [&] {
    v1::InitChunk c;
    c.set_job("j");
    c.set_tensor("w");
    c.set_dtype(v1::FP32);
    c.set_data(other.data(), kNumel * 4);
    auto written = store_.Init(c);
    ASSERT_TRUE(written.ok()) << written.status();
  });
  EXPECT_EQ(ReadFloats("j", "w", v1::MASTER), other);
}

// A gRPC reactor's forms wait without a thread: while the stream runs,
// OpenCommit with a wake and TryInit return at once with nothing done, and
// the stream's end runs the wake; asked again then, they go through.
TEST_F(StreamHoldsOffWritersTest, ACommitWithAWakeIsTurnedBackAndWokenWhenTheStreamEnds) {
  Create(request_);
  std::mt19937_64 rng(4);
  ASSERT_TRUE(Push("j", 1, 0, {{"w", RandomBf16(rng, kNumel, 0.5f)}}).ok());
  ASSERT_TRUE(Commit("j", 1, 1e-2).ok());
  ASSERT_TRUE(Push("j", 2, 0, {{"w", RandomBf16(rng, kNumel, 0.5f)}}).ok());
  v1::CommitRequest commit;
  commit.set_job("j");
  commit.set_step(2);
  commit.set_lr(1e-2);
  commit.set_gscale(1.0f);
  absl::Notification woken;
  CheckpointWhile(1, [&] {
    auto turned_back = store_.OpenCommit(commit, [&] { woken.Notify(); });
    ASSERT_TRUE(turned_back.ok()) << turned_back.status();
    EXPECT_EQ(*turned_back, nullptr);
  });
  ASSERT_TRUE(woken.WaitForNotificationWithTimeout(absl::Seconds(10)));
  auto opened = store_.OpenCommit(commit, [] {});
  ASSERT_TRUE(opened.ok()) << opened.status();
  ASSERT_NE(*opened, nullptr);
  for (;;) {
    auto piece = (*opened)->Next();
    ASSERT_TRUE(piece.ok()) << piece.status();
    if (!*piece) break;
  }
  EXPECT_EQ(store_.Describe("j")->step(), 2u);
}

TEST_F(StreamHoldsOffWritersTest, TryInitIsTurnedBackAndWokenWhenTheStreamEnds) {
  Create(request_);
  const std::vector<float> other = RandomFloats(rng_, kNumel, -1, 1);
  v1::InitChunk c;
  c.set_job("j");
  c.set_tensor("w");
  c.set_dtype(v1::FP32);
  c.set_data(other.data(), kNumel * 4);
  absl::Notification woken;
  CheckpointWhile(0, [&] {
    auto turned_back = store_.TryInit(c, [&] { woken.Notify(); });
    ASSERT_TRUE(turned_back.ok()) << turned_back.status();
    EXPECT_FALSE(turned_back->has_value());
  });
  ASSERT_TRUE(woken.WaitForNotificationWithTimeout(absl::Seconds(10)));
  auto written = store_.TryInit(c, [] {});
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(written->value_or(0), kNumel);
  EXPECT_EQ(ReadFloats("j", "w", v1::MASTER), other);
}

// A step whose checkpoint is complete already (COMMIT is there) has nothing
// to write, so its state is not streamed again, and holds nothing off.
TEST_F(StreamHoldsOffWritersTest, ACompleteStepIsNotStreamedAgain) {
  Create(request_);
  v1::CheckpointRequest request;
  request.set_job("j");
  request.set_step(0);
  ASSERT_TRUE(store_.Checkpoint(request).ok());
  ASSERT_EQ(probe_.slices.load(), probe_.total);
  auto again = store_.Checkpoint(request);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->complete());
  EXPECT_EQ(probe_.slices.load(), probe_.total);
}

// A job dropped while its checkpoint streams ends the checkpoint, NOT_FOUND,
// and the unfinished part leaves no file.
TEST_F(StreamHoldsOffWritersTest, AJobDroppedMidStreamEndsItsCheckpointAndLeavesNoFile) {
  Create(request_);
  v1::CheckpointRequest request;
  request.set_job("j");
  request.set_step(0);
  absl::StatusOr<v1::CheckpointResponse> written;
  std::thread checkpoint([&] { written = store_.Checkpoint(request); });
  probe_.second_slice.WaitForNotification();
  ASSERT_TRUE(store_.DropJob("j").ok());
  checkpoint.join();
  EXPECT_EQ(written.status().code(), absl::StatusCode::kNotFound) << written.status();
  EXPECT_LT(probe_.slices.load(), probe_.total);
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir_)) {
    EXPECT_FALSE(e.is_regular_file()) << e.path();
  }
}

}  // namespace
}  // namespace shardopt
