// A rolling restart under training: two ranks step a job on two servers
// with no checkpoint of their own asking, while a roller thread stops one
// server at a time with SIGTERM at random moments (aimed at pushes and at
// commits), waits for its drain, and starts it again on its port and
// directory. The ranks call Step again on UNAVAILABLE (the server down or
// draining), and nothing else may fail: every other error is the test's
// failure. The run must end in the bits of an uninterrupted one. Before the
// trainers completed the steps a drain tore (docs/design.md, section 7.4),
// such a restart ended the job in most runs of an outside probe.
#include <signal.h>

#include <atomic>
#include <chrono>
#include <iostream>
#include <mutex>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/testing/reference.h"
#include "tests/testing/scripted_trainer.h"

namespace shardopt {
namespace {

constexpr uint64_t kSteps = 48;
constexpr int kRestarts = 10;
constexpr uint32_t kRanks = 2;

// Rank r's gradients of step t: a function of (r, t) only, so that the
// uninterrupted run, on one server, gets the same.
std::vector<uint16_t> Gradients(uint32_t r, uint64_t t, uint64_t numel) {
  std::mt19937_64 rng(1000 * t + r);
  return testing::RandomBf16(rng, numel, 1.0f);
}

// Each rank steps `steps` steps of `job`; whether every rank's every step
// ended OK after calls again on UNAVAILABLE, before `deadline`, into `failed`.
void RunRanks(const JobOptions& job, const ClientOptions& options, uint64_t steps,
              const std::function<void(uint64_t)>& stepped, std::vector<absl::Status>* failed,
              std::vector<std::vector<uint16_t>>* params) {
  const uint64_t numel = job.tensors.front().numel;
  std::atomic<bool> initialized{false};  // rank 0's initial values are in: the others may push
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      ClientOptions o = options;
      o.rank = r;
      auto client = Client::Connect(o).value();
      absl::Status& st = (*failed)[r];
      st = client->CreateOrAttach(job).status();
      std::vector<float> init(numel);
      std::mt19937_64 rng(7);
      for (float& x : init) x = std::uniform_real_distribution<float>(-1, 1)(rng);
      if (st.ok() && r == 0) st = client->InitFp32(job.tensors.front().name, init.data());
      if (r == 0) initialized = true;
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(240);
      while (!initialized && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      StepOptions so;
      so.lr = 1e-2;
      std::vector<uint16_t>& p = (*params)[r];
      p.resize(numel);
      while (st.ok() && client->step() < steps) {
        const uint64_t t = client->step() + 1;
        const std::vector<uint16_t> g = Gradients(r, t, numel);
        absl::Status s = client->Step({{job.tensors.front().name, g.data()}}, so,
                                      {{job.tensors.front().name, p.data()}}).status();
        if (s.ok()) {
          if (r == 0) stepped(client->step());
          continue;
        }
        if (!absl::IsUnavailable(s) || std::chrono::steady_clock::now() > deadline) {
          st = absl::Status(s.code(), absl::StrCat("rank ", r, " step ", t, ": ", s.message()));
          break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    });
  }
  for (auto& t : threads) t.join();
}

TEST(DrainRollTest, TenRestartsOfOneServerAtATimeEndInTheUninterruptedBitsWithNoErrorButUnavailable) {
  JobOptions job;
  job.name = "roll";
  job.world_size = kRanks;
  job.groups = {GroupOptions{}};
  job.tensors = {{"w", 40000, 0}};  // ten blocks of 4096: five on each server
  job.barrier_timeout_ms = 10000;

  // The uninterrupted run: the same ranks, one server that stays up.
  std::vector<std::vector<uint16_t>> want(kRanks);
  {
    testing::TempDir dir;
    auto servers = testing::StartServers(1, dir.path());
    ClientOptions options;
    options.servers = {servers[0]->address()};
    std::vector<absl::Status> failed(kRanks);
    RunRanks(job, options, kSteps, [](uint64_t) {}, &failed, &want);
    for (const absl::Status& st : failed) ASSERT_TRUE(st.ok()) << st;
  }

  testing::TempDir dir;
  std::vector<std::vector<std::string>> args;
  std::vector<std::unique_ptr<testing::ServerProcess>> servers;
  ClientOptions options;
  for (int i = 0; i < 2; ++i) {
    args.push_back({"--threads=1", absl::StrCat("--port=", testing::FreeLoopbackPort()),
                    "--checkpoint_dir=" + dir.path()});
    servers.push_back(testing::ServerProcess::Start(args.back()));
    ASSERT_NE(servers.back(), nullptr);
    options.servers.push_back(servers.back()->address());
  }

  std::atomic<uint64_t> position{0};
  std::atomic<bool> finished{false}, release{false};
  std::atomic<int> restarts{0}, exits_not_zero{0};
  const uint64_t seed = std::random_device{}();
  std::cout << "restart schedule seed " << seed << std::endl;
  // The roller starts the servers it restarts, which die with it (a spawned
  // child's death signal follows its thread): it stays until released.
  std::thread roller([&] {
    std::mt19937_64 rng(seed);
    for (int k = 0; k < kRestarts && !finished; ++k) {
      const uint64_t at = 2 + k * (kSteps - 8) / kRestarts + rng() % 3;
      while (position.load() < at && !finished) std::this_thread::sleep_for(std::chrono::microseconds(200));
      if (finished) break;
      std::this_thread::sleep_for(std::chrono::microseconds(rng() % 8000));
      const int i = k % 2;
      if (servers[i]->Stop(SIGTERM) >> 8 != 0) ++exits_not_zero;
      std::this_thread::sleep_for(std::chrono::milliseconds(rng() % 200));
      servers[i] = testing::ServerProcess::Start(args[i]);
      if (servers[i] == nullptr) break;
      ++restarts;
    }
    while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  });

  std::vector<absl::Status> failed(kRanks);
  std::vector<std::vector<uint16_t>> got(kRanks);
  RunRanks(job, options, kSteps, [&](uint64_t step) { position = step; }, &failed, &got);
  finished = true;
  for (const absl::Status& st : failed) EXPECT_TRUE(st.ok()) << st;
  std::cout << restarts.load() << " restarts (seed " << seed << ")" << std::endl;
  EXPECT_GE(restarts.load(), kRestarts - 2) << "the run ended before the restarts";
  EXPECT_EQ(exits_not_zero.load(), 0) << "a drain failed";
  EXPECT_EQ(got, want) << "params differ from the uninterrupted run's";
  release = true;
  roller.join();
}

}  // namespace
}  // namespace shardopt
