// Scale-out with real processes on loopback: shardopt-server processes and
// shardopt-scale-worker processes, each rank its own process, as in a job.
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/scale/scale_job.h"
#include "tests/testing/server_process.h"

namespace shardopt::scale {
namespace {

using ::testing::HasSubstr;
using testing::ReadText;
using testing::ServerProcess;
using testing::SpawnProcess;
using testing::WaitProcess;
using namespace std::chrono_literals;

// S servers and the workers of one job, all children of this thread (a
// server dies with the thread that started it).
class Cluster {
 public:
  // With `pattern`, server i listens on 127.0.i.1 (all of 127/8 is
  // loopback), every one on the same port, as a StatefulSet's pods do, and
  // the workers are given the pattern instead of the list.
  explicit Cluster(uint32_t servers, bool pattern = false) {
    char tmpl[] = "/tmp/shardopt-scale-XXXXXX";
    dir_ = mkdtemp(tmpl);
    std::vector<std::string> flags = {"--threads=1"};
    if (pattern) {
      servers_.push_back(ServerProcess::Start(flags));  // its ephemeral port, then reused on the other hosts
      if (servers_.back() == nullptr) return;
      pattern_ = absl::StrCat("127.0.{i}.1:", servers_.back()->port());
      flags.push_back(absl::StrCat("--port=", servers_.back()->port()));
    }
    for (uint32_t s = servers_.size(); s < servers; ++s) {
      std::vector<std::string> args = flags;
      if (pattern) args.push_back(absl::StrCat("--host=127.0.", s, ".1"));
      servers_.push_back(ServerProcess::Start(args));
      if (servers_.back() == nullptr) return;
    }
    for (uint32_t s = 0; s < servers; ++s) {
      addresses_.push_back(pattern ? absl::StrCat("127.0.", s, ".1:", servers_[s]->port()) : servers_[s]->address());
    }
  }
  ~Cluster() {
    for (pid_t pid : workers_) {
      kill(pid, SIGKILL);
      WaitProcess(pid, 5s);
    }
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  bool ok() const { return !servers_.empty() && servers_.back() != nullptr && !addresses_.empty(); }
  ServerProcess& server(uint32_t s) { return *servers_[s]; }
  const std::vector<std::string>& addresses() const { return addresses_; }
  std::string out() const { return dir_ + "/out"; }

  pid_t StartWorker(uint32_t rank, uint32_t world, uint64_t steps, std::vector<std::string> flags = {}) {
    std::vector<std::string> argv = {SHARDOPT_WORKER_BINARY,
                                     pattern_.empty() ? "--servers=" + absl::StrJoin(addresses_, ",")
                                                      : "--server_pattern=" + pattern_,
                                     absl::StrCat("--server_count=", addresses_.size()),
                                     absl::StrCat("--rank=", rank),
                                     absl::StrCat("--world_size=", world),
                                     absl::StrCat("--steps=", steps),
                                     "--out=" + out()};
    argv.insert(argv.end(), flags.begin(), flags.end());
    workers_.push_back(SpawnProcess(argv));
    return workers_.back();
  }
  // One worker's wait status, or nullopt if it is still running after `timeout`.
  std::optional<int> WaitWorker(pid_t pid, std::chrono::milliseconds timeout) {
    auto status = WaitProcess(pid, timeout);
    if (status) workers_.erase(std::find(workers_.begin(), workers_.end(), pid));
    return status;
  }
  // Waits for each worker; false if one did not end in time or failed.
  bool WaitWorkers(std::chrono::milliseconds timeout) {
    const auto give_up = std::chrono::steady_clock::now() + timeout;
    bool all_ok = true;
    for (pid_t pid : workers_) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(give_up - std::chrono::steady_clock::now());
      auto status = WaitProcess(pid, std::max(left, 0ms));
      if (!status) {
        ADD_FAILURE() << "worker " << pid << " still running";
        kill(pid, SIGKILL);
        WaitProcess(pid, 5s);
        all_ok = false;
      } else if (!WIFEXITED(*status) || WEXITSTATUS(*status) != 0) {
        all_ok = false;
      }
    }
    workers_.clear();
    return all_ok;
  }
  std::string Log(uint32_t rank) const { return ReadText(OutputPath(out(), rank) + ".log"); }
  WorkerOutput Output(uint32_t rank, const JobOptions& job) const {
    uint64_t masters = 0;
    for (const TensorOptions& t : job.tensors) masters += t.numel;
    auto out_or = ReadOutput(OutputPath(out(), rank), masters);
    EXPECT_TRUE(out_or.ok()) << out_or.status() << "\n" << Log(rank);
    return out_or.ok() ? *out_or : WorkerOutput{};
  }
  // Waits until `rank` has written that it stalled.
  bool WaitStalled(uint32_t rank, std::chrono::milliseconds timeout) {
    const auto give_up = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < give_up) {
      if (std::filesystem::exists(OutputPath(out(), rank) + ".stalled")) return true;
      std::this_thread::sleep_for(10ms);
    }
    return false;
  }
  // Every server's step for the job, through a client of this process.
  std::vector<uint64_t> ServerSteps(const JobOptions& job) {
    ClientOptions o;
    o.servers = addresses_;
    o.max_attempts = 1;
    auto client = Client::Connect(o).value();
    std::vector<uint64_t> steps;
    if (auto st = client->CreateOrAttach(job); !st.ok()) {
      ADD_FAILURE() << st.status();
      return steps;
    }
    auto described = client->Describe();
    if (!described.ok()) {
      ADD_FAILURE() << described.status();
      return steps;
    }
    for (const ServerState& s : *described) steps.push_back(s.step);
    return steps;
  }

 private:
  std::string dir_;
  std::vector<std::unique_ptr<ServerProcess>> servers_;
  std::vector<std::string> addresses_;
  std::string pattern_;
  std::vector<pid_t> workers_;
};

std::vector<float> Gscales(uint64_t steps, float gscale) { return std::vector<float>(steps, gscale); }

TEST(ScaleOut, FourWorkersOnThreeServersClipAlikeAndMatchTheReference) {
  constexpr uint32_t kWorkers = 4;
  constexpr uint64_t kSteps = 200;
  Cluster cluster(3, /*pattern=*/true);
  ASSERT_TRUE(cluster.ok());
  const JobOptions job = MakeJob("scale", kWorkers, 10000);
  for (uint32_t r = 0; r < kWorkers; ++r) {
    cluster.StartWorker(r, kWorkers, kSteps, {"--max_grad_norm=20", "--barrier_timeout_ms=10000"});
  }
  ASSERT_TRUE(cluster.WaitWorkers(120s)) << cluster.Log(0);
  const WorkerOutput rank0 = cluster.Output(0, job);
  ASSERT_EQ(rank0.gscales.size(), kSteps);
  // Clipping was active: every rank reached the same clip factor from the
  // servers' partials, and a clip below 1.
  EXPECT_LT(*std::min_element(rank0.gscales.begin(), rank0.gscales.end()), 1.0f / kWorkers);
  for (uint32_t r = 1; r < kWorkers; ++r) {
    const WorkerOutput out = cluster.Output(r, job);
    EXPECT_EQ(out.gscales, rank0.gscales) << "rank " << r;
    EXPECT_EQ(out.masters, rank0.masters) << "rank " << r;
  }
  EXPECT_EQ(rank0.masters, ReferenceMasters(job, 1, rank0.gscales));
}

TEST(ScaleOut, WithoutClippingMastersAreBitwiseEqualForOneTwoThreeAndFiveServers) {
  constexpr uint32_t kWorkers = 2;
  constexpr uint64_t kSteps = 200;
  const JobOptions job = MakeJob("scale", kWorkers, 10000);
  const std::vector<float> expected = ReferenceMasters(job, 1, Gscales(kSteps, 1.0f / kWorkers));
  for (uint32_t servers : {1u, 2u, 3u, 5u}) {
    Cluster cluster(servers);
    ASSERT_TRUE(cluster.ok());
    for (uint32_t r = 0; r < kWorkers; ++r) cluster.StartWorker(r, kWorkers, kSteps);
    ASSERT_TRUE(cluster.WaitWorkers(120s)) << cluster.Log(0);
    EXPECT_EQ(cluster.Output(0, job).masters, expected) << servers << " servers";
  }
}

TEST(ScaleOut, AWorkerKilledMidStepLeavesNothingAppliedAndItsRestartRejoins) {
  constexpr uint32_t kWorkers = 4, kVictim = 2;
  constexpr uint64_t kSteps = 40, kStall = 20;
  constexpr uint32_t kBarrierMs = 1000;
  Cluster cluster(3);
  ASSERT_TRUE(cluster.ok());
  const JobOptions job = MakeJob("scale", kWorkers, kBarrierMs);
  const std::string barrier = absl::StrCat("--barrier_timeout_ms=", kBarrierMs);
  pid_t victim = 0;
  for (uint32_t r = 0; r < kWorkers; ++r) {
    std::vector<std::string> flags = {barrier};
    if (r == kVictim) {
      // Half-pushed: server 1 has every rank's gradients and seals the
      // round; servers 0 and 2 lack the victim's.
      flags.push_back(absl::StrCat("--stall_at_step=", kStall));
      flags.push_back("--stall_after_pushing_server=1");
    }
    const pid_t pid = cluster.StartWorker(r, kWorkers, kSteps, flags);
    if (r == kVictim) victim = pid;
  }
  // The others push step kStall and wait at the barriers of servers 0 and 2,
  // which expire at least once while the victim hangs and once more after it
  // is killed.
  ASSERT_TRUE(cluster.WaitStalled(kVictim, 60s));
  const std::vector<uint64_t> before(3, kStall - 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(kBarrierMs * 3 / 2));
  EXPECT_EQ(cluster.ServerSteps(job), before);
  kill(victim, SIGKILL);
  ASSERT_TRUE(cluster.WaitWorker(victim, 5s).has_value());
  std::this_thread::sleep_for(std::chrono::milliseconds(kBarrierMs * 3 / 2));
  EXPECT_EQ(cluster.ServerSteps(job), before);  // nothing applied anywhere

  cluster.StartWorker(kVictim, kWorkers, kSteps, {barrier});
  ASSERT_TRUE(cluster.WaitWorkers(120s)) << cluster.Log(0);
  EXPECT_THAT(cluster.Log(kVictim), HasSubstr(absl::StrCat("pushed step ", kStall, " to server 1 only")));
  EXPECT_THAT(cluster.Log(kVictim), HasSubstr(absl::StrCat("attached at step ", kStall - 1)));
  const std::vector<float> expected = ReferenceMasters(job, 1, Gscales(kSteps, 1.0f / kWorkers));
  for (uint32_t r = 0; r < kWorkers; ++r) {
    EXPECT_EQ(cluster.Output(r, job).masters, expected) << "rank " << r;
    if (r == kVictim) continue;
    const std::string log = cluster.Log(r);
    EXPECT_THAT(log, HasSubstr(absl::StrCat("step ", kStall, " attempt 1: DEADLINE_EXCEEDED")));
    EXPECT_THAT(log, HasSubstr("nothing was applied"));
  }
}

TEST(ScaleOut, AServerKilledWhileWorkersWaitGivesThemAClearErrorLongBeforeTheDeadline) {
  constexpr uint32_t kBarrierMs = 30000;
  Cluster cluster(3);
  ASSERT_TRUE(cluster.ok());
  const std::string barrier = absl::StrCat("--barrier_timeout_ms=", kBarrierMs);
  const pid_t waiting = cluster.StartWorker(0, 2, 10, {barrier});
  cluster.StartWorker(1, 2, 10, {barrier, "--stall_at_step=5"});
  ASSERT_TRUE(cluster.WaitStalled(1, 60s));
  std::this_thread::sleep_for(300ms);  // rank 0 is at step 5's barrier on every server
  const auto killed_at = std::chrono::steady_clock::now();
  cluster.server(1).Stop(SIGKILL);
  const auto status = cluster.WaitWorker(waiting, std::chrono::milliseconds(kBarrierMs / 3));
  ASSERT_TRUE(status.has_value()) << "rank 0 still waits after the server died";
  EXPECT_LT(std::chrono::steady_clock::now() - killed_at, std::chrono::milliseconds(kBarrierMs / 3));
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 2);
  const std::string log = cluster.Log(0);
  EXPECT_THAT(log, HasSubstr(absl::StrCat("step 5 attempt 1: UNAVAILABLE: ", cluster.addresses()[1])));
}

// Rank 0's gradients of step 1 and views of them.
struct StepOneGradients {
  explicit StepOneGradients(const JobOptions& job) {
    for (uint32_t t = 0; t < job.tensors.size(); ++t) {
      grads.push_back(Gradient(1, 1, 0, t, job.tensors[t].numel));
      views.push_back({job.tensors[t].name, grads.back().data()});  // a moved vector keeps its buffer
    }
  }
  std::vector<std::vector<uint16_t>> grads;
  std::vector<GradView> views;
};

// The trainer id of the tests' world_size-1 trainer, whose clients stand
// for one trainer.
constexpr uint64_t kTrainer = 7;

// Sets the job's initial values and does step 1 on server 0 alone, as a
// world_size-1 trainer that died between its commits to two servers would
// (or one whose commit to server 1 failed).
void StepServerZeroAlone(const std::vector<std::string>& servers, const JobOptions& job) {
  ClientOptions options;
  options.servers = servers;
  options.push_servers = {0};
  options.trainer = kTrainer;
  auto lopsided = Client::Connect(options).value();
  ASSERT_EQ(lopsided->CreateOrAttach(job).value(), 0u);
  for (uint32_t t = 0; t < job.tensors.size(); ++t) {
    const auto init = InitialValues(1, t, job.tensors[t].numel);
    ASSERT_TRUE(lopsided->InitFp32(job.tensors[t].name, init.data()).ok());
  }
  const StepOneGradients step_one(job);
  ASSERT_TRUE(lopsided->Push(1, step_one.views).ok());
  ASSERT_TRUE(lopsided->Commit(1, kLr, 1.0f, false, {}).ok());
}

TEST(ScaleOut, ServersAtDifferentStepsAreRefusedWithEachStepAndWhatToDo) {
  Cluster cluster(2);
  ASSERT_TRUE(cluster.ok());
  const JobOptions job = MakeJob("split", 1, 10000);
  ASSERT_NO_FATAL_FAILURE(StepServerZeroAlone(cluster.addresses(), job));
  ClientOptions options;
  options.servers = cluster.addresses();
  auto trainer = Client::Connect(options).value();
  auto attached = trainer->CreateOrAttach(job);
  EXPECT_EQ(attached.status().code(), absl::StatusCode::kFailedPrecondition);
  const std::string message(attached.status().message());
  EXPECT_THAT(message, HasSubstr(cluster.addresses()[0] + " at step 1"));
  EXPECT_THAT(message, HasSubstr(cluster.addresses()[1] + " at step 0"));
  EXPECT_THAT(message, HasSubstr("restore every server from one checkpoint, or drop the job"));
}

TEST(ScaleOut, AStepCommittedOnSomeServersIsCompletedByRetryingIt) {
  Cluster cluster(2);
  ASSERT_TRUE(cluster.ok());
  const JobOptions job = MakeJob("heal", 1, 10000);
  ClientOptions options;
  options.servers = cluster.addresses();
  options.trainer = kTrainer;  // the same trainer, whose commit to server 1 failed
  auto trainer = Client::Connect(options).value();
  ASSERT_EQ(trainer->CreateOrAttach(job).value(), 0u);  // attached while both servers were at step 0
  ASSERT_NO_FATAL_FAILURE(StepServerZeroAlone(cluster.addresses(), job));

  StepOptions step_options;
  step_options.lr = kLr;
  const StepOneGradients step_one(job);
  auto retried = trainer->Step(step_one.views, step_options, {});
  ASSERT_TRUE(retried.ok()) << retried.status();
  EXPECT_EQ(retried->step, 1u);
  EXPECT_EQ(cluster.ServerSteps(job), std::vector<uint64_t>({1, 1}));
  std::vector<float> masters;
  for (const TensorOptions& t : job.tensors) {
    std::vector<float> m(t.numel);
    ASSERT_TRUE(trainer->Read(t.name, StateToRead::kMaster, 0, t.numel, m.data()).ok());
    masters.insert(masters.end(), m.begin(), m.end());
  }
  EXPECT_EQ(masters, ReferenceMasters(job, 1, {1.0f}));  // applied once on each server
}

}  // namespace
}  // namespace shardopt::scale
