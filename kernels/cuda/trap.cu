#include "kernels/cuda/trap.h"

namespace shardopt::cuda {
namespace {

__global__ void TrapKernel() { __trap(); }

}  // namespace

cudaError_t LaunchTrap(cudaStream_t stream) {
  TrapKernel<<<1, 1, 0, stream>>>();
  return cudaGetLastError();
}

}  // namespace shardopt::cuda
