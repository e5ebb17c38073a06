// shardopt-bench: the benchmarks of DESIGN.md's performance budget. Each
// subcommand prints one JSON object on stdout; a failure prints one with an
// "error" key and exits 1.
#include <algorithm>
#include <iostream>
#include <string>
#include <vector>

#include "bench/benches.h"

int main(int argc, char** argv) {
  const std::string command = argc > 1 ? argv[1] : "";
  const std::vector<std::string> args(argv + std::min(argc, 2), argv + argc);
  absl::StatusOr<nlohmann::json> result =
      command == "kernel" ? shardopt::bench::KernelBench(args)
      : command == "e2e"  ? shardopt::bench::E2eBench(args)
      : command == "checkpoint" ? shardopt::bench::CheckpointBench(args)
                          : absl::InvalidArgumentError("usage: shardopt-bench kernel|e2e|checkpoint [--name=value ...]");
  if (!result.ok()) {
    std::cout << nlohmann::json{{"benchmark", command}, {"error", result.status().ToString()}}.dump() << std::endl;
    return 1;
  }
  std::cout << result->dump() << std::endl;
  return 0;
}
