// The device kernels' launchers. Each returns the launch's error, which the
// caller turns into a status; execution errors surface at the next sync.
#pragma once

#include <cuda_runtime_api.h>

#include "kernels/cuda/kernel_args.h"

namespace shardopt::cuda {

// One fused AdamW step over every task of the launch; writes p, m, v and the
// bf16 params.
cudaError_t LaunchUpdate(const Launch& launch, cudaStream_t stream);
// One partial of adamw_math.h's sum-of-squares tree per reduction block, into
// launch.partials in unit order.
cudaError_t LaunchReduce(const Launch& launch, cudaStream_t stream);

}  // namespace shardopt::cuda
