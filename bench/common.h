// What the subcommands of shardopt-bench share: counts on the command line, a
// gradient payload, and best-of timing.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardopt::bench {

// A count flag's value: digits with an optional binary suffix (K, M, G), or
// 2^k, so that a size reads as it is meant: 64M, 2^26.
struct Count {
  uint64_t value = 0;
};
bool AbslParseFlag(absl::string_view text, Count* count, std::string* error);
std::string AbslUnparseFlag(Count count);

// bf16 bits of positive values in [2^-10, 1), from a fixed seed. Positive,
// so that the roofline's v += g keeps v positive and neither loop meets a
// NaN; bounded away from zero, so no denormal slows either one down.
void FillGradients(uint16_t* out, uint64_t n);

// Runs every measurement once to warm up, then `reps` more times, interleaved
// so that a noisy spell on a shared machine hits them alike; returns each
// one's fastest time in seconds, the run least disturbed by neighbours. With
// `cpu_seconds`, also the CPU time the whole process spent (every thread,
// on every core) in that fastest run: on a machine whose cores are all busy,
// the cost that decides the speed.
absl::StatusOr<std::vector<double>> BestOfInterleaved(uint64_t reps,
                                                      const std::vector<std::function<absl::Status()>>& runs,
                                                      std::vector<double>* cpu_seconds = nullptr);

}  // namespace shardopt::bench
