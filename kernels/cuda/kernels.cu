#include "kernels/cuda/kernels.h"

#include "kernels/cuda/kernel_bodies.h"

namespace shardopt::cuda {

cudaError_t LaunchUpdate(const Launch& launch, cudaStream_t stream) {
  UpdateKernelFor(launch)<<<launch.unit_count, kThreads, 0, stream>>>(launch);
  return cudaGetLastError();
}

cudaError_t LaunchReduce(const Launch& launch, cudaStream_t stream) {
  ReduceKernelFor(launch)<<<launch.unit_count, kThreads, 0, stream>>>(launch);
  return cudaGetLastError();
}

}  // namespace shardopt::cuda
