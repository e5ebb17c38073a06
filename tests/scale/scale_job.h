// The job the scale-out tests train, shared by the worker executable and the
// tests' in-process references: its tensors, and gradients and initial values
// that are pure functions of (seed, step, rank, tensor, index), so that a
// restarted worker and the reference reproduce them exactly.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/step_scalars.h"
#include "shardopt/client.h"

namespace shardopt::scale {

inline const AdamWHyper kHyper{0.9, 0.999, 1e-8f, 0.01, 1.0};
inline constexpr double kLr = 1e-3;

// 13 blocks of 4096 in the flat space: every server of up to 13 holds a part,
// and tensors straddle server boundaries. `size` multiplies the tensors'
// lengths, for tests where the gradient's bytes must dominate the server's.
JobOptions MakeJob(const std::string& name, uint32_t world_size, uint32_t barrier_timeout_ms, uint32_t size = 1);

std::vector<uint16_t> Gradient(uint64_t seed, uint64_t step, uint32_t rank, uint32_t tensor, uint64_t numel);
std::vector<float> InitialValues(uint64_t seed, uint32_t tensor, uint64_t numel);

// What a worker writes at the end: the final masters of every tensor, end to
// end in job order, and the gscale each step was committed with.
struct WorkerOutput {
  std::vector<float> masters;
  std::vector<float> gscales;  // [step - 1]
};
std::string OutputPath(const std::string& prefix, uint32_t rank);
absl::Status WriteOutput(const std::string& path, const WorkerOutput& output);
absl::StatusOr<WorkerOutput> ReadOutput(const std::string& path, uint64_t masters);

// The final masters of a single-process run: every rank's gradient summed in
// rank order in fp32, each step committed with gscales[step - 1].
std::vector<float> ReferenceMasters(const JobOptions& job, uint64_t seed, const std::vector<float>& gscales);

}  // namespace shardopt::scale
