#include "kernels/gpu.h"

namespace shardopt {

int UsableGpuCount() { return 0; }
std::string GpuUnavailableReason() { return "this build has no CUDA (configure with -DSHARDOPT_CUDA=ON)"; }
absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int) {
  return absl::FailedPreconditionError("this build has no CUDA backend; rebuild with -DSHARDOPT_CUDA=ON");
}
absl::Status CudaBackendHealth(const Backend&) { return absl::OkStatus(); }
absl::StatusOr<DeviceMemory> CudaDeviceMemory(const Backend&) {
  return absl::NotFoundError("this build has no CUDA backend");
}
absl::StatusOr<GpuKernelBench> BenchCudaKernel(uint64_t, int, int) {
  return absl::FailedPreconditionError("this build has no CUDA backend; rebuild with -DSHARDOPT_CUDA=ON");
}

}  // namespace shardopt
