// A kernel that traps, for the test of what a sticky error does.
#pragma once

#include <cuda_runtime_api.h>

namespace shardopt::cuda {

cudaError_t LaunchTrap(cudaStream_t stream);

}  // namespace shardopt::cuda
