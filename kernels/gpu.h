// The CUDA backend's entry points. This header has no CUDA in it, so the
// server can name the backend without CUDA headers; builds without CUDA link
// gpu_none.cc instead.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace shardopt {

// The number of GPUs the runtime can use; 0 where there is no driver, no
// device, or no CUDA in this build (cudaGetDeviceCount's error means "none").
int UsableGpuCount();
// Why UsableGpuCount() is 0, for logs.
std::string GpuUnavailableReason();
// Fails with a clear status (never aborts) when the device cannot be used.
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device);

}  // namespace shardopt
