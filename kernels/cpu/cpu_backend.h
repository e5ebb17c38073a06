#pragma once

#include <memory>

#include "kernels/backend.h"
#include "kernels/cpu/loops.h"

namespace shardopt {

struct CpuBackendOptions {
  int threads = 0;  // 0: one per core
  cpu::Isa isa = cpu::BestIsa();
};

std::unique_ptr<Backend> MakeCpuBackend(const CpuBackendOptions& options = {});

// The kernel's roofline (docs/design.md, section 10.1): runs the `stream`
// loop where state.Apply(steps) would run the update, over the same buffers,
// on the same threads, in the same items and tiles. `state` must be a CPU backend's job
// with FP32 shards and one rank's bf16 gradient; it overwrites their state.
absl::Status RunCpuStreamRoofline(JobState& state, absl::Span<const ShardStep> steps);

}  // namespace shardopt
