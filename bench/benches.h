// The subcommands of shardopt-bench. Each takes its arguments, already checked
// by bench/main.cc, and returns the one JSON object it prints.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace shardopt::bench {

struct KernelArgs {
  uint64_t elements = 0;    // >= 1
  uint64_t threads = 0;     // CPU threads; 0: one per core
  int cuda_device = -1;     // -1: the CPU backend
  uint64_t iterations = 0;  // >= 1
};
absl::StatusOr<nlohmann::json> KernelBench(const KernelArgs& args);

struct E2eArgs {
  uint64_t params = 0;   // >= tensors
  uint64_t tensors = 0;  // >= 1
  uint64_t steps = 0;    // >= 1
  uint64_t chunk_bytes = 0;  // the client's; 0: its default, else 2 at least
  uint64_t threads = 0;  // each server's CPU threads; 0: one per core
  uint64_t servers = 0;  // 1 to 64
  uint64_t workers = 0;  // 1 to 64
  int cuda_device = -1;  // every server's backend: -1 the CPU, else this CUDA device
};
absl::StatusOr<nlohmann::json> E2eBench(const E2eArgs& args);

struct CheckpointArgs {
  uint64_t elements = 0;  // >= 1
  std::string dir;        // scratch, emptied first and removed after
  uint64_t reps = 0;      // >= 1
};
absl::StatusOr<nlohmann::json> CheckpointBench(const CheckpointArgs& args);

struct AbuseArgs {
  std::string server_binary;  // shardopt-server
  uint64_t seconds = 0;       // per attack, >= 1
  uint64_t memory_limit = 0;  // the server's --memory_limit, bytes
};
absl::StatusOr<nlohmann::json> AbuseBench(const AbuseArgs& args);

}  // namespace shardopt::bench
