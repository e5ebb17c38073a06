// The CUDA backend's entry points. This header has no CUDA in it, so the
// server can name the backend without CUDA headers; builds without CUDA link
// gpu_none.cc instead.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
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
// OK for any backend but CUDA's. For CUDA's, UNAVAILABLE with the CUDA error
// text once an error has made its device unusable; from then on every call
// into the backend and its jobs fails with that status.
absl::Status CudaBackendHealth(const Backend& backend);

// A CUDA backend's device memory now (cudaMemGetInfo), for the server's
// metrics; NOT_FOUND for any other backend.
struct DeviceMemory {
  uint64_t free = 0;
  uint64_t total = 0;
};
absl::StatusOr<DeviceMemory> CudaDeviceMemory(const Backend& backend);

// The fused update (one rank, bf16 gradients, FP32 state) against
// device-to-device copy bandwidth, both timed with CUDA events in one run.
struct GpuKernelBench {
  double elements_per_second;
  double copy_bytes_per_second;  // bytes read plus bytes written by cudaMemcpy
  double bytes_per_element;      // the update's traffic: 14 read, 14 written
};
absl::StatusOr<GpuKernelBench> BenchCudaKernel(uint64_t elements, int device, int iterations);

}  // namespace shardopt
