#include "kernels/cuda/testing.h"

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/cuda/backend.h"
#include "kernels/cuda/job.h"
#include "kernels/cuda/trap.h"

namespace shardopt::cuda_testing {

absl::Status FillParamsOut(JobState& job, uint32_t shard, uint8_t byte) {
  auto* cuda_job = dynamic_cast<cuda::CudaJobState*>(&job);
  if (cuda_job == nullptr) return absl::InvalidArgumentError("not a CUDA job");
  return cuda_job->FillParamsOut(shard, byte);
}

absl::StatusOr<uint64_t> FreeDeviceBytes(int device) {
  SHARDOPT_ASSIGN_OR_RETURN(auto info, cuda::MemoryInfo(device));
  return info.first;
}

absl::Status BreakDevice(Backend& backend) {
  auto* cuda_backend = dynamic_cast<cuda::CudaBackend*>(&backend);
  if (cuda_backend == nullptr) return absl::InvalidArgumentError("not a CUDA backend");
  const cuda::Device& device = cuda_backend->device();
  SHARDOPT_RETURN_IF_ERROR(device.Enter());
  SHARDOPT_RETURN_IF_ERROR(device.Check(cuda::LaunchTrap(nullptr), "the trap launch"));
  return device.Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

}  // namespace shardopt::cuda_testing
