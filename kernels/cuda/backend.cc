#include "kernels/cuda/backend.h"

#include "base/status_macros.h"
#include "kernels/cuda/job.h"
#include "kernels/gpu.h"

namespace shardopt {
namespace cuda {

absl::StatusOr<std::unique_ptr<JobState>> CudaBackend::Allocate(const JobLayout& layout) {
  SHARDOPT_ASSIGN_OR_RETURN(auto job, CudaJobState::Create(device_, layout));
  return std::unique_ptr<JobState>(std::move(job));
}

}  // namespace cuda

// A machine without a driver answers cudaGetDeviceCount with an error, which
// means "no GPU" here.
int UsableGpuCount() {
  const absl::StatusOr<int> count = cuda::VisibleDeviceCount();
  return count.ok() ? *count : 0;
}

std::string GpuUnavailableReason() {
  const absl::StatusOr<int> count = cuda::VisibleDeviceCount();
  if (!count.ok()) return std::string(count.status().message());
  if (*count == 0) return "the CUDA runtime sees no device";
  return "";
}

absl::StatusOr<std::unique_ptr<Backend>> MakeCudaBackend(int device) {
  SHARDOPT_ASSIGN_OR_RETURN(auto opened, cuda::Device::Open(device));
  return std::make_unique<cuda::CudaBackend>(std::move(opened));
}

absl::StatusOr<DeviceMemory> CudaDeviceMemory(const Backend& backend) {
  const auto* cuda_backend = dynamic_cast<const cuda::CudaBackend*>(&backend);
  if (cuda_backend == nullptr) return absl::NotFoundError("not a CUDA backend");
  SHARDOPT_ASSIGN_OR_RETURN(auto info, cuda::MemoryInfo(cuda_backend->device().index()));
  return DeviceMemory{info.first, info.second};
}

absl::Status CudaBackendHealth(const Backend& backend) {
  const auto* cuda_backend = dynamic_cast<const cuda::CudaBackend*>(&backend);
  return cuda_backend == nullptr ? absl::OkStatus() : cuda_backend->device().health();
}

}  // namespace shardopt
