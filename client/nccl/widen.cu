#include "client/nccl/widen.h"

namespace shardopt::nccl {
namespace {

__global__ void WidenBf16Kernel(const uint16_t* in, float* out, uint64_t n) {
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < n; i += uint64_t{gridDim.x} * blockDim.x) {
    out[i] = __uint_as_float(static_cast<uint32_t>(in[i]) << 16);  // exact: bf16 is fp32's top half
  }
}

}  // namespace

cudaError_t WidenBf16(const uint16_t* in, float* out, uint64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  constexpr unsigned kThreads = 256;
  const unsigned blocks = static_cast<unsigned>(std::min<uint64_t>((n + kThreads - 1) / kThreads, 65535));
  WidenBf16Kernel<<<blocks, kThreads, 0, stream>>>(in, out, n);
  return cudaGetLastError();
}

}  // namespace shardopt::nccl
