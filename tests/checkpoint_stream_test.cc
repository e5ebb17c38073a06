// A checkpoint streams the job's state to disk without copying it first
// (the writer's few buffers are direct_io_test's), and nothing writes the
// state until the stream is through, so the part holds exactly the step it
// names; what waits for it holds no thread, in the store and over gRPC.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "checkpoint/format.h"
#include "checkpoint/job_directory.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "kernels/cpu/cpu_backend.h"
#include "server/job_store.h"
#include "server/service.h"
#include "shardopt/v1/optimizer.grpc.pb.h"
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
// its first slice and its last. The store's seam (after_snapshot_slice)
// pauses the stream after its second slice, without the job's lock, until
// the test lets it go on: whatever the test does then, it does while the
// state streams.
struct StreamProbe {
  int total = 0;  // slices in one snapshot of the job
  std::atomic<int> slices{0};
  std::atomic<int> writes_mid_stream{0};
  absl::Notification paused;
  absl::Notification resume;
};

class ProbedJobState final : public testing::ForwardingJobState {
 public:
  ProbedJobState(std::unique_ptr<JobState> cpu, StreamProbe* probe)
      : ForwardingJobState(std::move(cpu)), probe_(probe) {}
  char* HostFp32State(uint32_t shard, StateKind kind) override {
    ++probe_->slices;
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
                                 MakeCpuBackend({})->Describe(),
                                 [this](std::unique_ptr<JobState> s) {
                                   return std::unique_ptr<JobState>(
                                       std::make_unique<ProbedJobState>(std::move(s), &probe_));
                                 }),
                             [this] {
                               if (++after_slices_ != 2) return;
                               probe_.paused.Notify();
                               probe_.resume.WaitForNotification();
                             }) {
    probe_.total = 3 * static_cast<int>(kNumel >> 18);
  }

  // Checkpoints step `step` on a thread of its own and, with its stream
  // paused after the second slice, runs `act` on a thread of its own. An
  // `act` that must wait for the stream (`waits`) must still be running
  // 200 ms into the pause (after `started`, which must not wait), and goes
  // on when the stream does; one that must not wait must end within 30 s,
  // and the stream then goes on either way, so that no test hangs. Then
  // checks that the part holds the state as it was before, bitwise, and
  // that nothing wrote it midway. With `set_aside` (initial values written
  // after a checkpoint of step 0), the step must have been set aside, and
  // it is put back to be checked.
  void CheckpointWhile(uint64_t step, const std::function<void()>& act, bool waits,
                       absl::Notification* started = nullptr, bool set_aside = false) {
    const std::string before = Snapshot("j");
    v1::CheckpointRequest request;
    request.set_job("j");
    request.set_step(step);
    absl::StatusOr<v1::CheckpointResponse> written;
    std::thread checkpoint([&] { written = store_.Checkpoint(request); });
    probe_.paused.WaitForNotification();
    absl::Notification done;
    std::thread actor([&] {
      act();
      done.Notify();
    });
    if (waits) {
      if (started != nullptr) {
        EXPECT_TRUE(started->WaitForNotificationWithTimeout(absl::Seconds(30))) << "it waited for the stream";
      }
      EXPECT_FALSE(done.WaitForNotificationWithTimeout(absl::Milliseconds(200))) << "it did not wait for the stream";
    } else {
      EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(30))) << "it waited for the stream";
    }
    probe_.resume.Notify();
    actor.join();
    checkpoint.join();
    ASSERT_TRUE(written.ok()) << written.status();
    EXPECT_EQ(probe_.slices.load(), probe_.total);
    EXPECT_EQ(probe_.writes_mid_stream.load(), 0);
    if (set_aside) PutBackSetAside(step);

    auto backend = MakeCpuBackend({});
    JobStore fresh(backend.get(), Options0(dir_));
    auto restored = fresh.CreateJob(request_);
    ASSERT_TRUE(restored.ok()) << restored.status();
    ASSERT_TRUE(restored->restored());
    EXPECT_EQ(restored->step(), step);
    EXPECT_TRUE(Snapshot(fresh, "j") == before);  // not EXPECT_EQ: gtest would diff 30 MB strings
  }

  // The COMMIT and part of `step` that initial values written after its
  // checkpoint set aside (checkpoint::SetAsideStepOfOldValues), renamed
  // back into the step's directory: there must be exactly one of each.
  void PutBackSetAside(uint64_t step) {
    const std::string job_dir = dir_ + "/j";
    const std::string step_dir = checkpoint::StepDirectory(dir_, "j", step);
    const std::string prefix = "abandoned-" + std::filesystem::path(step_dir).filename().string() + "-";
    std::map<std::string, std::string> back;  // name in the step's directory -> set-aside path
    for (const auto& entry : std::filesystem::directory_iterator(job_dir)) {
      const std::string file = entry.path().filename().string();
      if (file.rfind(prefix, 0) != 0) continue;
      const std::string name = file.substr(prefix.size(), file.rfind('-') - prefix.size());
      EXPECT_TRUE(back.emplace(name, entry.path().string()).second) << name << " set aside twice";
    }
    ASSERT_EQ(back.size(), 2u) << "the COMMIT and the part";
    ASSERT_TRUE(back.count("COMMIT")) << "no COMMIT set aside";
    for (const auto& [name, from] : back) {
      EXPECT_FALSE(std::filesystem::exists(step_dir + "/" + name)) << name << " left in place";
      std::filesystem::rename(from, step_dir + "/" + name);
    }
  }

  // Creates the job, steps it once and pushes step 2, so that a checkpoint
  // of step 1 has a sealed round behind it that a commit would apply.
  void StepOnceAndPushTheNext(uint64_t seed) {
    Create(request_);
    std::mt19937_64 rng(seed);
    ASSERT_TRUE(Push("j", 1, 0, {{"w", RandomBf16(rng, kNumel, 0.5f)}}).ok());
    ASSERT_TRUE(Commit("j", 1, 1e-2).ok());
    ASSERT_TRUE(Push("j", 2, 0, {{"w", RandomBf16(rng, kNumel, 0.5f)}}).ok());
  }
  static v1::CommitRequest CommitOfTheNext() {
    v1::CommitRequest commit;
    commit.set_job("j");
    commit.set_step(2);
    commit.set_lr(1e-2);
    commit.set_gscale(1.0f);
    return commit;
  }

  // Creates the job and checkpoints step 0 again, with `deadline`, while a
  // first checkpoint of it streams (CheckpointWhile); `check` gets its answer.
  void SecondCheckpointWhileTheFirstStreams(
      absl::Time deadline, bool waits, const std::function<void(const absl::StatusOr<v1::CheckpointResponse>&)>& check) {
    Create(request_);
    v1::CheckpointRequest request;
    request.set_job("j");
    request.set_step(0);
    CheckpointWhile(0, [&] { check(store_.Checkpoint(request, deadline)); }, waits);
  }

  StreamProbe probe_;
  std::atomic<int> after_slices_{0};
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
  absl::Notification pushed;
  CheckpointWhile(
      1,
      [&] {
        EXPECT_TRUE(Push("j", 2, 0, {{"w", grad}}, 1 << 16).ok());
        pushed.Notify();
        auto committed = Commit("j", 2, 1e-2);
        EXPECT_TRUE(committed.ok()) << committed.status();
      },
      /*waits=*/true, &pushed);
  EXPECT_EQ(store_.Describe("j")->step(), 2u);
}

// A job dropped while the SIGTERM drain writes its checkpoint was dropped on
// purpose: the drain has no failure for it. Its failed write was one, and
// the server exited 1 as for a disk that failed (an outside probe).
TEST_F(StreamHoldsOffWritersTest, AJobDroppedWhileTheDrainWritesItIsNoFailureOfTheDrain) {
  Create(request_);
  std::vector<std::pair<std::string, absl::StatusOr<v1::CheckpointResponse>>> results;
  std::thread drain([&] { results = store_.DrainAndCheckpoint(absl::Seconds(5)); });
  probe_.paused.WaitForNotification();
  const absl::Status dropped = store_.DropJob("j", 0, /*only_if_empty=*/false);
  probe_.resume.Notify();
  drain.join();
  ASSERT_TRUE(dropped.ok()) << dropped;
  for (const auto& [name, result] : results) ADD_FAILURE() << name << ": " << result.status();
  EXPECT_EQ(store_.Describe("j").status().code(), absl::StatusCode::kNotFound);
}

// Init at step 0 (as a load_state_dict after the first checkpoint) waits
// for the stream too.
TEST_F(StreamHoldsOffWritersTest, InitWaitsForTheStream) {
  Create(request_);
  const std::vector<float> other = RandomFloats(rng_, kNumel, -1, 1);
  CheckpointWhile(
      0,
      [&] {
        v1::InitChunk c;
        c.set_job("j");
        c.set_tensor("w");
        c.set_dtype(v1::FP32);
        c.set_data(other.data(), kNumel * 4);
        auto written = store_.Init(c);
        EXPECT_TRUE(written.ok()) << written.status();
      },
      /*waits=*/true, /*started=*/nullptr, /*set_aside=*/true);
  EXPECT_EQ(ReadFloats("j", "w", v1::MASTER), other);
}

// A gRPC reactor's forms wait without a thread: while the stream runs,
// OpenCommit with a wake and TryInit return at once with nothing done, and
// the stream's end runs the wake; asked again then, they go through.
TEST_F(StreamHoldsOffWritersTest, ACommitWithAWakeIsTurnedBackAndWokenWhenTheStreamEnds) {
  ASSERT_NO_FATAL_FAILURE(StepOnceAndPushTheNext(4));
  const v1::CommitRequest commit = CommitOfTheNext();
  absl::Notification woken;
  CheckpointWhile(
      1,
      [&] {
        auto turned_back = store_.OpenCommit(commit, [&] { woken.Notify(); });
        ASSERT_TRUE(turned_back.ok()) << turned_back.status();
        EXPECT_EQ(*turned_back, nullptr);
      },
      /*waits=*/false);
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
  CheckpointWhile(
      0,
      [&] {
        auto turned_back = store_.TryInit(c, [&] { woken.Notify(); });
        ASSERT_TRUE(turned_back.ok()) << turned_back.status();
        EXPECT_FALSE(turned_back->has_value());
      },
      /*waits=*/false);
  ASSERT_TRUE(woken.WaitForNotificationWithTimeout(absl::Seconds(10)));
  auto written = store_.TryInit(c, [] {});
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_EQ(written->value_or(0), kNumel);
  EXPECT_EQ(ReadFloats("j", "w", v1::MASTER), other);
}

// A step whose checkpoint is complete already (COMMIT is there) has nothing
// to write, so its state is not streamed again: the second checkpoint
// locates no slice.
TEST_F(StreamHoldsOffWritersTest, ACompleteStepIsNotStreamedAgain) {
  probe_.resume.Notify();  // no pause
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

// A second checkpoint of the job while one is written (a client retrying
// one whose deadline passed) waits for it, rather than writing the same part
// beside it (two writers of one part could leave a COMMIT listing the other's
// file): until its own deadline, then DEADLINE_EXCEEDED naming the first...
TEST_F(StreamHoldsOffWritersTest, ASecondCheckpointOfTheJobWaitsOnlyUntilItsDeadline) {
  SecondCheckpointWhileTheFirstStreams(absl::Now() + absl::Milliseconds(100), /*waits=*/false, [](const auto& late) {
    EXPECT_EQ(late.status().code(), absl::StatusCode::kDeadlineExceeded) << late.status();
    EXPECT_NE(late.status().message().find("still being written"), absl::string_view::npos) << late.status();
  });
}

// ... and with time enough, until the first is done: then it finds the step
// complete and streams nothing (CheckpointWhile counts every slice).
TEST_F(StreamHoldsOffWritersTest, ASecondCheckpointOfTheJobWaitsForTheFirstAndFindsItComplete) {
  SecondCheckpointWhileTheFirstStreams(absl::InfiniteFuture(), /*waits=*/true, [](const auto& again) {
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_TRUE(again->complete());
    EXPECT_EQ(again->part_bytes(), 0u);
  });
}

// A job dropped while its checkpoint streams ends the checkpoint, NOT_FOUND,
// and the unfinished part leaves no file: only the drop's mark of the job's
// life (checkpoint::MarkLifeDropped).
TEST_F(StreamHoldsOffWritersTest, AJobDroppedMidStreamEndsItsCheckpointAndLeavesNoFile) {
  Create(request_);
  v1::CheckpointRequest request;
  request.set_job("j");
  request.set_step(0);
  absl::StatusOr<v1::CheckpointResponse> written;
  std::thread checkpoint([&] { written = store_.Checkpoint(request); });
  probe_.paused.WaitForNotification();
  EXPECT_TRUE(store_.DropJob("j").ok());
  probe_.resume.Notify();
  checkpoint.join();
  EXPECT_EQ(written.status().code(), absl::StatusCode::kNotFound) << written.status();
  EXPECT_LT(probe_.slices.load(), probe_.total);
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir_)) {
    EXPECT_TRUE(!e.is_regular_file() || checkpoint::IsDroppedLifeMark(e.path().filename().string())) << e.path();
  }
}

// Over gRPC (this store served in-process on 127.0.0.1): commits of the
// next step that arrive while the checkpoint streams are turned back by the
// commit reactor without a thread, woken at the stream's end, reopened on
// one of gRPC's threads (an alarm), and answer with that step's params.
TEST_F(StreamHoldsOffWritersTest, OverGrpcCommitsWaitForTheStreamThenAnswer) {
  ASSERT_NO_FATAL_FAILURE(StepOnceAndPushTheNext(6));
  ServerOptions options;
  options.address = "127.0.0.1:0";
  auto running = StartServer(&store_, options);
  ASSERT_TRUE(running.ok()) << running.status();
  auto stub = v1::Optimizer::NewStub(grpc::CreateChannel(absl::StrCat("127.0.0.1:", (*running)->port),
                                                         grpc::InsecureChannelCredentials()));
  const v1::CommitRequest commit = CommitOfTheNext();
  constexpr int kCommits = 4;
  std::vector<std::string> params(kCommits, std::string(kNumel * 2, '\0'));
  std::vector<grpc::Status> statuses(kCommits);
  CheckpointWhile(
      1,
      [&] {
        std::vector<std::thread> callers;
        for (int i = 0; i < kCommits; ++i) {
          callers.emplace_back([&, i] {
            grpc::ClientContext context;  // a commit never woken fails the test, not hangs it
            context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
            auto reader = stub->Commit(&context, commit);
            v1::ParamChunk chunk;
            while (reader->Read(&chunk)) {
              params[i].replace(chunk.offset() * 2, chunk.data().size(), chunk.data());
            }
            statuses[i] = reader->Finish();
          });
        }
        for (std::thread& c : callers) c.join();
      },
      /*waits=*/true);
  const std::string want = ReadBytes(store_, "j", "w", v1::PARAM_BF16);
  for (int i = 0; i < kCommits; ++i) {
    EXPECT_TRUE(statuses[i].ok()) << statuses[i].error_message();
    EXPECT_TRUE(params[i] == want) << "commit " << i;
  }
  EXPECT_EQ(store_.Describe("j")->step(), 2u);
}

}  // namespace
}  // namespace shardopt
