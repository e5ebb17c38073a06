// The subcommands of shardopt-bench. Each takes its --name=value arguments and
// returns the one JSON object it prints.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace shardopt::bench {

absl::StatusOr<nlohmann::json> KernelBench(const std::vector<std::string>& args);
absl::StatusOr<nlohmann::json> E2eBench(const std::vector<std::string>& args);
absl::StatusOr<nlohmann::json> CheckpointBench(const std::vector<std::string>& args);

}  // namespace shardopt::bench
