// Crash recovery with real kill -9: a 200-step run on two servers that
// checkpoints every 20 steps, while a killer thread SIGKILLs the servers at
// random moments during pushes, commits and checkpoint writes. After each
// kill both servers restart on the shared directory, the job resumes from the
// last complete checkpoint, and the run ends with the bits of an
// uninterrupted run.
#include <signal.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <random>
#include <thread>

#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "tests/testing/scripted_trainer.h"

namespace shardopt {
namespace {

namespace fs = std::filesystem;
using testing::ScriptedTrainer;
using Phase = ScriptedTrainer::Phase;

constexpr uint64_t kSteps = 200;
constexpr uint64_t kEvery = 20;
constexpr int kKills = 24;
// Where the trainer is, for the killer: the two step phases, plus these.
constexpr int kCheckpointing = 3;
constexpr int kIdle = static_cast<int>(Phase::kIdle);

int Code(Phase p) { return static_cast<int>(p); }

TEST(CrashTest, TwentyFourKillNinesAtRandomMomentsEndInTheUninterruptedBits) {
  const JobOptions job = testing::DurableJob("crash", {{"w", 9000}, {"b", 700}});
  const std::vector<uint32_t> expected = testing::Uninterrupted(job, {kSteps})[0];
  testing::TempDir dir;
  ClientOptions options;
  options.max_attempts = 1;  // a dead server is the test's to handle, at once
  options.rpc_timeout_ms = 10000;

  std::mutex mu;
  std::condition_variable cv;
  std::vector<pid_t> pids;
  bool killed = false;
  bool done = false;
  std::atomic<int> phase{kIdle};
  std::atomic<uint64_t> position{0};  // the job's step as the trainer last saw it
  int kills_in[4] = {0, 0, 0, 0};  // by phase at the moment of the kill

  const uint64_t seed = std::random_device{}();
  std::cout << "kill schedule seed " << seed << std::endl;
  std::thread killer([&] {
    std::mt19937_64 rng(seed);
    for (int k = 0; k < kKills; ++k) {
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return !killed || done; });
        if (done) return;
      }
      // Kill k waits until the run passes its own point of the run, so that
      // the kills spread over all of it and resumes start from many
      // checkpoints, while every kill still comes before the end.
      const uint64_t wait_for = k * (kSteps - 20) / kKills + rng() % 12;
      while (position.load() < wait_for) {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
        std::lock_guard<std::mutex> lock(mu);
        if (done) return;
      }
      // Aim at one phase in turn; kill anyway if it does not come within 2 s.
      // A kill in a checkpoint always loses the one being written, so only
      // every fourth kill aims there, or the run would hardly move.
      const int target = k % 4 == 3 ? kCheckpointing : Code(k % 2 == 0 ? Phase::kPush : Phase::kCommit);
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(2);
      while (phase.load() != target && std::chrono::steady_clock::now() < give_up) {
        std::this_thread::sleep_for(std::chrono::microseconds(20));
      }
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 400));
      std::lock_guard<std::mutex> lock(mu);
      if (done) return;
      ++kills_in[phase.load()];
      const size_t first = rng() % pids.size();
      for (size_t i = 0; i < pids.size(); ++i) kill(pids[(first + i) % pids.size()], SIGKILL);
      killed = true;
    }
  });

  auto servers = testing::StartServers(2, dir.path());
  auto client = testing::Connect(servers, options);
  ScriptedTrainer trainer(job);
  {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& s : servers) pids.push_back(s->pid());
  }
  ASSERT_EQ(client->CreateOrAttach(job).value(), 0u);
  ASSERT_TRUE(trainer.Init(*client).ok());
  int restarts = 0;
  int torn_seen = 0;  // torn checkpoints that restarts had to pass over
  std::error_code ec;
  std::vector<uint64_t> resumed_at;
  // After a kill: reap both servers, start two fresh ones on the same
  // directory and attach; returns the step the job resumed at.
  auto restart = [&]() -> uint64_t {
    for (auto& s : servers) s->Stop(SIGKILL);
    for (const auto& e : fs::directory_iterator(dir.path() + "/crash", ec)) {
      if (!fs::exists(e.path() / "COMMIT")) ++torn_seen;
    }
    servers = testing::StartServers(2, dir.path());
    client = testing::Connect(servers, options);
    return client->CreateOrAttach(job).value();
  };
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(150);
  while (client->step() < kSteps) {
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << "the run took too long";
    absl::Status st = trainer.Step(*client, [&](Phase p) { phase = Code(p); }).status();
    if (st.ok()) position = client->step();
    if (st.ok() && client->step() % kEvery == 0) {
      phase = kCheckpointing;
      st = client->Checkpoint();
      phase = kIdle;
    }
    if (st.ok()) continue;
    phase = kIdle;
    {
      std::unique_lock<std::mutex> lock(mu);
      ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(10), [&] { return killed; }))
          << "a step failed without a kill: " << st;
    }
    const uint64_t step = restart();
    ASSERT_EQ(step % kEvery, 0u) << "resumed at a step that was never checkpointed";
    if (step == 0) {
      ASSERT_TRUE(trainer.Init(*client).ok());
    }
    resumed_at.push_back(step);
    position = step;
    ++restarts;
    std::lock_guard<std::mutex> lock(mu);
    pids.clear();
    for (const auto& s : servers) pids.push_back(s->pid());
    killed = false;
    cv.notify_all();
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    done = true;
    cv.notify_all();
  }
  killer.join();
  if (killed) {  // the last kill came after step 200 was done
    ASSERT_EQ(restart(), kSteps);
  }

  std::cout << "kills: " << kills_in[Code(Phase::kPush)] << " in a push, " << kills_in[Code(Phase::kCommit)]
            << " in a commit, " << kills_in[kCheckpointing] << " in a checkpoint, " << kills_in[kIdle]
            << " between them; " << restarts << " restarts, resumed at steps " << absl::StrJoin(resumed_at, ",")
            << "; torn checkpoints seen: " << torn_seen << std::endl;
  EXPECT_GE(kills_in[0] + kills_in[1] + kills_in[2] + kills_in[3], 20);
  EXPECT_GT(kills_in[Code(Phase::kPush)], 0);
  EXPECT_GT(kills_in[Code(Phase::kCommit)], 0);
  EXPECT_GT(kills_in[kCheckpointing], 0);
  EXPECT_EQ(testing::Fingerprint(*client, job).value(), expected);
}

}  // namespace
}  // namespace shardopt
