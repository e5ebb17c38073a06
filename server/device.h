// --device selection: auto, cpu, cuda, cuda:N.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace shardopt {

// The device index of "cuda" (0) or "cuda:N" (N >= 0); anything else is
// INVALID_ARGUMENT. The server's --device and the bench's share it.
absl::StatusOr<int> CudaDeviceIndex(const std::string& device);

// With `auto_requires_gpu` (what the GPU image passes), `auto` that finds no
// usable GPU is FAILED_PRECONDITION instead of the CPU: a GPU pod that would
// quietly run on its host's cores fails loudly. `cpu` still means the CPU.
absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const std::string& device, int cpu_threads,
                                                     bool auto_requires_gpu = false);

}  // namespace shardopt
