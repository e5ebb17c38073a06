// What the subcommands of shardopt-bench share: --name=value flags, a
// gradient payload, and best-of timing.
#pragma once

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace shardopt::bench {

class Flags {
 public:
  // Every argument must be --name=value, with a name from `known`.
  static absl::StatusOr<Flags> Parse(const std::vector<std::string>& args,
                                     std::initializer_list<const char*> known);
  // A count: digits with an optional binary suffix (K, M, G), or 2^k.
  absl::StatusOr<uint64_t> Count(const std::string& name, uint64_t fallback) const;
  std::string String(const std::string& name, const std::string& fallback) const;

 private:
  std::map<std::string, std::string> values_;
};

// bf16 bits of positive values in [2^-10, 1), from a fixed seed. Positive,
// so that the roofline's v += g keeps v positive and neither loop meets a
// NaN; bounded away from zero, so no denormal slows either one down.
void FillGradients(uint16_t* out, uint64_t n);

// Runs every measurement once to warm up, then `reps` more times, interleaved
// so that a noisy spell on a shared machine hits them alike; returns each
// one's fastest time in seconds, the run least disturbed by neighbours.
absl::StatusOr<std::vector<double>> BestOfInterleaved(uint64_t reps,
                                                      const std::vector<std::function<absl::Status()>>& runs);

}  // namespace shardopt::bench
