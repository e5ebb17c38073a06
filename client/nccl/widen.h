// The one kernel the NCCL collective needs: bf16 to fp32, exactly.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace shardopt::nccl {

cudaError_t WidenBf16(const uint16_t* in, float* out, uint64_t n, cudaStream_t stream);

}  // namespace shardopt::nccl
