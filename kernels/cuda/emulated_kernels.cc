// The kernels' own source, compiled by the host compiler under emulation.h.
#include "kernels/cuda/emulated_kernels.h"

#include "kernels/cuda/emulation.h"
// After emulation.h, which it needs in place of CUDA's headers.
#include "kernels/cuda/kernel_bodies.h"

namespace shardopt::cuda::emulated {

void LaunchUpdate(const Launch& launch) {
  emulation::RunKernel(UpdateKernelFor(launch), launch.unit_count, kThreads, launch);
}

void LaunchReduce(const Launch& launch) {
  emulation::RunKernel(ReduceKernelFor(launch), launch.unit_count, kThreads, launch);
}

}  // namespace shardopt::cuda::emulated
