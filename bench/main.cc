// shardopt-bench: the benchmarks of the performance budgets in
// docs/design.md (section 10). Each subcommand prints one JSON object on
// stdout; a failure prints one with an "error" key and exits 1. A bad
// argument exits 2, printing no JSON.
#include <algorithm>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "bench/benches.h"
#include "bench/common.h"
#include "server/device.h"
#include "tools/flags.h"

using shardopt::bench::Count;

// Every flag is optional, with its default applied by the subcommand, so that
// a flag that only another subcommand takes is refused rather than ignored.
ABSL_FLAG(std::optional<Count>, elements, std::nullopt,
          "kernel: elements updated (default 2^26); checkpoint: elements of the job's one tensor (default 2^23)");
ABSL_FLAG(std::optional<Count>, threads, std::nullopt, "kernel, e2e: CPU backend threads (default 0: one per core)");
ABSL_FLAG(std::optional<std::string>, device, std::nullopt, "kernel, e2e: cpu, cuda or cuda:N (default cpu)");
ABSL_FLAG(std::optional<Count>, iterations, std::nullopt, "kernel: timed runs, the best one kept (default 30)");
ABSL_FLAG(std::optional<Count>, params, std::nullopt, "e2e: the model's params (default 64M)");
ABSL_FLAG(std::optional<Count>, tensors, std::nullopt, "e2e: tensors the params are split into (default 1)");
ABSL_FLAG(std::optional<Count>, steps, std::nullopt, "e2e: timed steps, the best one kept (default 5)");
ABSL_FLAG(std::optional<Count>, chunk_bytes, std::nullopt,
          "e2e: the client's bytes per gradient message (default: the client's choice, 4M for one worker)");
ABSL_FLAG(std::optional<Count>, servers, std::nullopt, "e2e: servers, 1 to 64 (default 1)");
ABSL_FLAG(std::optional<Count>, workers, std::nullopt, "e2e: worker clients, 1 to 64 (default 1)");
ABSL_FLAG(std::optional<std::string>, dir, std::nullopt,
          "checkpoint: a scratch directory, emptied first and removed after (default shardopt-checkpoint-bench "
          "in the temporary directory)");
ABSL_FLAG(std::optional<Count>, reps, std::nullopt, "checkpoint: timed runs, the best one kept (default 3)");
ABSL_FLAG(std::optional<Count>, seconds, std::nullopt, "abuse: seconds each attack runs (default 5)");
ABSL_FLAG(std::optional<Count>, memory_limit, std::nullopt, "abuse: the server's --memory_limit in bytes (default 1G)");
ABSL_FLAG(std::optional<std::string>, server_binary, std::nullopt,
          "abuse: the shardopt-server to attack (default: the one built or installed next to shardopt-bench)");

namespace {

namespace bench = shardopt::bench;

constexpr char kUsage[] =
    "the benchmarks of the performance budgets in docs/design.md; each prints one JSON object.\n"
    "usage:\n"
    "  shardopt-bench kernel [--elements=N] [--threads=N] [--device=cpu|cuda|cuda:N] [--iterations=N]\n"
    "  shardopt-bench e2e [--params=N] [--tensors=N] [--steps=N] [--chunk_bytes=N] [--threads=N] [--servers=N]\n"
    "                     [--workers=N] [--device=cpu|cuda|cuda:N]\n"
    "  shardopt-bench checkpoint [--elements=N] [--dir=DIR] [--reps=N]\n"
    "  shardopt-bench abuse [--seconds=N] [--memory_limit=N] [--server_binary=PATH]\n"
    "A count N is digits with an optional K, M or G (binary), or 2^k: 1000, 64M, 2^26.";

uint64_t Get(const absl::Flag<std::optional<Count>>& flag, uint64_t fallback) {
  const std::optional<Count> count = absl::GetFlag(flag);
  return count ? count->value : fallback;
}

// Refuses the flags that were given and `command` does not take.
void CheckFlagsOf(const std::string& command, const std::vector<std::string>& takes) {
  const std::vector<std::pair<std::string, bool>> given = {
      {"elements", absl::GetFlag(FLAGS_elements).has_value()},
      {"threads", absl::GetFlag(FLAGS_threads).has_value()},
      {"device", absl::GetFlag(FLAGS_device).has_value()},
      {"iterations", absl::GetFlag(FLAGS_iterations).has_value()},
      {"params", absl::GetFlag(FLAGS_params).has_value()},
      {"tensors", absl::GetFlag(FLAGS_tensors).has_value()},
      {"steps", absl::GetFlag(FLAGS_steps).has_value()},
      {"chunk_bytes", absl::GetFlag(FLAGS_chunk_bytes).has_value()},
      {"servers", absl::GetFlag(FLAGS_servers).has_value()},
      {"workers", absl::GetFlag(FLAGS_workers).has_value()},
      {"dir", absl::GetFlag(FLAGS_dir).has_value()},
      {"reps", absl::GetFlag(FLAGS_reps).has_value()},
      {"seconds", absl::GetFlag(FLAGS_seconds).has_value()},
      {"memory_limit", absl::GetFlag(FLAGS_memory_limit).has_value()},
      {"server_binary", absl::GetFlag(FLAGS_server_binary).has_value()},
  };
  for (const auto& [name, was_given] : given) {
    if (was_given && std::find(takes.begin(), takes.end(), name) == takes.end()) {
      shardopt::UsageError(absl::StrCat(command, " does not take --", name, "; it takes --",
                                        absl::StrJoin(takes, ", --")));
    }
  }
}

// --device as a CUDA device's index, or -1 for the CPU (the default).
int CudaDeviceFlag() {
  const std::string device = absl::GetFlag(FLAGS_device).value_or("cpu");
  if (device == "cpu") return -1;
  absl::StatusOr<int> index = shardopt::CudaDeviceIndex(device);
  if (!index.ok()) shardopt::UsageError(absl::StrCat("--device must be cpu, cuda or cuda:N, got '", device, "'"));
  return *index;
}

absl::StatusOr<nlohmann::json> Kernel() {
  CheckFlagsOf("kernel", {"elements", "threads", "device", "iterations"});
  bench::KernelArgs args;
  args.elements = Get(FLAGS_elements, uint64_t{1} << 26);
  args.threads = Get(FLAGS_threads, 0);
  args.iterations = Get(FLAGS_iterations, 30);
  if (args.elements == 0) shardopt::UsageError("--elements must be at least 1");
  if (args.iterations == 0) shardopt::UsageError("--iterations must be at least 1");
  args.cuda_device = CudaDeviceFlag();
  return bench::KernelBench(args);
}

absl::StatusOr<nlohmann::json> E2e() {
  CheckFlagsOf("e2e", {"params", "tensors", "steps", "chunk_bytes", "threads", "servers", "workers", "device"});
  bench::E2eArgs args;
  args.params = Get(FLAGS_params, uint64_t{64} << 20);
  args.tensors = Get(FLAGS_tensors, 1);
  args.steps = Get(FLAGS_steps, 5);
  args.chunk_bytes = Get(FLAGS_chunk_bytes, 0);
  args.threads = Get(FLAGS_threads, 0);
  args.servers = Get(FLAGS_servers, 1);
  args.workers = Get(FLAGS_workers, 1);
  args.cuda_device = CudaDeviceFlag();
  if (args.servers == 0 || args.servers > 64 || args.workers == 0 || args.workers > 64) {
    shardopt::UsageError("need 1 <= --servers, --workers <= 64");
  }
  if (args.tensors == 0 || args.params < args.tensors) shardopt::UsageError("need 1 <= --tensors <= --params");
  if (args.steps == 0) shardopt::UsageError("--steps must be at least 1");
  if (args.chunk_bytes == 1) shardopt::UsageError("--chunk_bytes must hold one param, 2 bytes");
  return bench::E2eBench(args);
}

absl::StatusOr<nlohmann::json> Checkpoint() {
  CheckFlagsOf("checkpoint", {"elements", "dir", "reps"});
  bench::CheckpointArgs args;
  args.elements = Get(FLAGS_elements, uint64_t{1} << 23);
  args.dir = absl::GetFlag(FLAGS_dir).value_or(std::filesystem::temp_directory_path() / "shardopt-checkpoint-bench");
  args.reps = Get(FLAGS_reps, 3);
  if (args.elements == 0) shardopt::UsageError("--elements must be at least 1");
  if (args.reps == 0) shardopt::UsageError("--reps must be at least 1");
  return bench::CheckpointBench(args);
}

// The server next to this binary: installed side by side, or in the build
// tree's server/ beside bench/.
std::string DefaultServerBinary() {
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe").parent_path();
  for (const auto& candidate : {self / "shardopt-server", self / ".." / "server" / "shardopt-server"}) {
    if (std::filesystem::exists(candidate)) return candidate.lexically_normal();
  }
  return "shardopt-server";
}

absl::StatusOr<nlohmann::json> Abuse() {
  CheckFlagsOf("abuse", {"seconds", "memory_limit", "server_binary"});
  bench::AbuseArgs args;
  args.seconds = Get(FLAGS_seconds, 5);
  args.memory_limit = Get(FLAGS_memory_limit, uint64_t{1} << 30);
  args.server_binary = absl::GetFlag(FLAGS_server_binary).value_or(DefaultServerBinary());
  if (args.seconds == 0) shardopt::UsageError("--seconds must be at least 1");
  if (args.memory_limit < (uint64_t{64} << 20)) shardopt::UsageError("--memory_limit must be at least 64M");
  return bench::AbuseBench(args);
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args = shardopt::ParseFlags(argc, argv, kUsage);
  if (args.empty()) shardopt::UsageError(absl::StrCat("no subcommand given\n", kUsage));
  if (args.size() > 1) {
    shardopt::UsageError(absl::StrCat("unexpected arguments after the subcommand: ",
                                      absl::StrJoin(args.begin() + 1, args.end(), " ")));
  }
  const std::string& command = args[0];
  absl::StatusOr<nlohmann::json> result;
  if (command == "kernel") {
    result = Kernel();
  } else if (command == "e2e") {
    result = E2e();
  } else if (command == "checkpoint") {
    result = Checkpoint();
  } else if (command == "abuse") {
    result = Abuse();
  } else {
    shardopt::UsageError(absl::StrCat("unknown subcommand '", command, "'\n", kUsage));
  }
  if (!result.ok()) {
    std::cout << nlohmann::json{{"benchmark", command}, {"error", result.status().ToString()}}.dump() << std::endl;
    return 1;
  }
  std::cout << result->dump() << std::endl;
  return 0;
}
