// Hooks for the GPU tests, in a library of their own (shardopt_cuda_testing)
// so that nothing in the product links them. No CUDA in this header.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace shardopt::cuda_testing {

// Sets every byte of a shard's device bf16 params in a CUDA job, so that a
// test can tell an element the kernel wrote from one it skipped.
absl::Status FillParamsOut(JobState& job, uint32_t shard, uint8_t byte);
// cudaMemGetInfo's free bytes on `device`.
absl::StatusOr<uint64_t> FreeDeviceBytes(int device);
// Runs a kernel that traps on the backend's device: a sticky error that
// leaves the device unusable for the rest of the process. Returns the status
// the failure produced.
absl::Status BreakDevice(Backend& backend);

}  // namespace shardopt::cuda_testing
