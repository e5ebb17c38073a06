// Gradient staging does not grow with the number of ranks: W = 1, 8, 32 and
// 64 worker processes push to one server through a window that is full at
// every W > 1, and the results stay bitwise equal to the rank-order
// reference. staging_bytes is the server's stated bound (sum + params + the
// window's cap), checked flat; the server's peak RSS is printed beside it,
// not asserted (it is not flat: README, "Gradient staging").
#include <signal.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "tests/scale/scale_job.h"
#include "tests/testing/server_process.h"

namespace shardopt::scale {
namespace {

using testing::ReadText;
using testing::ServerProcess;
using testing::SpawnProcess;
using testing::WaitProcess;
using namespace std::chrono_literals;

constexpr uint64_t kWindowBytes = 256 << 10;
constexpr uint64_t kSteps = 3;
// 2.25M params, 4.5 MB of bf16 gradient per rank, in 1 MiB chunks: the
// 256 KiB window is full at every W > 1, and the ranks' chunks wait on it.
constexpr uint32_t kSize = 50;

// The peak resident set of a process, from /proc.
uint64_t PeakRssBytes(pid_t pid) {
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmHWM:", 0) == 0) {
      std::vector<std::string> parts = absl::StrSplit(line, ' ', absl::SkipEmpty());
      return std::stoull(parts[1]) * 1024;
    }
  }
  return 0;
}

struct Measured {
  uint64_t staging_bytes = 0;
  uint64_t peak_rss_bytes = 0;
};

Measured TrainWith(uint32_t world) {
  auto server = ServerProcess::Start({"--threads=1", absl::StrCat("--staging_window_bytes=", kWindowBytes)});
  EXPECT_NE(server, nullptr);
  if (server == nullptr) return {};
  char tmpl[] = "/tmp/shardopt-staging-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  const std::string out = dir + "/out";
  std::vector<pid_t> workers;
  for (uint32_t r = 0; r < world; ++r) {
    workers.push_back(SpawnProcess({SHARDOPT_WORKER_BINARY, "--servers=" + server->address(),
                                    absl::StrCat("--rank=", r), absl::StrCat("--world_size=", world),
                                    absl::StrCat("--steps=", kSteps), absl::StrCat("--size=", kSize),
                                    "--barrier_timeout_ms=30000", "--step_attempts=8",
                                    "--out=" + out}));
  }
  const auto give_up = std::chrono::steady_clock::now() + 240s;
  for (pid_t pid : workers) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(give_up - std::chrono::steady_clock::now());
    auto status = WaitProcess(pid, std::max(left, 0ms));
    if (!status) kill(pid, SIGKILL);
    EXPECT_TRUE(status && WIFEXITED(*status) && WEXITSTATUS(*status) == 0)
        << "a worker of " << world << " failed: " << ReadText(OutputPath(out, static_cast<uint32_t>(&pid - workers.data())) + ".log");
  }
  const JobOptions job = MakeJob("scale", world, 30000, kSize);
  uint64_t masters = 0;
  for (const TensorOptions& t : job.tensors) masters += t.numel;
  const std::vector<float> expected = ReferenceMasters(job, 1, std::vector<float>(kSteps, 1.0f / world));
  for (uint32_t r = 0; r < world; ++r) {
    auto output = ReadOutput(OutputPath(out, r), masters);
    EXPECT_TRUE(output.ok()) << output.status();
    if (output.ok()) {
      EXPECT_EQ(output->masters, expected) << "rank " << r << " of " << world;
    }
  }
  Measured run;
  ClientOptions options;
  options.servers = {server->address()};
  auto client = Client::Connect(options).value();
  EXPECT_TRUE(client->CreateOrAttach(job).ok());
  auto described = client->Describe();
  EXPECT_TRUE(described.ok()) << described.status();
  if (described.ok()) run.staging_bytes = described->front().staging_bytes;
  run.peak_rss_bytes = PeakRssBytes(server->pid());
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return run;
}

TEST(Staging, BitwiseAtEveryWorldSizeWithAStagingBoundFlatInTheRanks) {
  uint64_t params = 0;
  for (const TensorOptions& t : MakeJob("scale", 1, 1000, kSize).tensors) params += t.numel;
  std::vector<std::pair<uint32_t, Measured>> runs;
  for (uint32_t world : {1u, 8u, 32u, 64u}) runs.emplace_back(world, TrainWith(world));
  std::printf("ranks  staging_bytes  server_peak_rss_bytes  per-rank-slots_bytes (before)\n");
  for (const auto& [world, run] : runs) {
    std::printf("%5u  %13llu  %21llu  %29llu\n", world, static_cast<unsigned long long>(run.staging_bytes),
                static_cast<unsigned long long>(run.peak_rss_bytes),
                static_cast<unsigned long long>(uint64_t{world} * params * 2 + params * 2));
  }
  // 4 B/param of running sum, 2 B/param of params out (both padded per
  // shard), and the window: the same for every W whose window is at the cap.
  const uint64_t flat = runs[1].second.staging_bytes;
  EXPECT_LE(flat, params * 6 + 6 * 13 * 64 + kWindowBytes);
  EXPECT_EQ(runs[2].second.staging_bytes, flat);
  EXPECT_EQ(runs[3].second.staging_bytes, flat);
  // The server's peak RSS is printed, not asserted: on 2 cores it swings by
  // 2x from run to run with how many ranks' Init and Commit messages are in
  // flight at once (docs/design.md, staging), which the running sum does not
  // hold.
}

}  // namespace
}  // namespace shardopt::scale
