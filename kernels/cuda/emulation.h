// CUDA's vocabulary for the host compiler, so that device code (the kernels
// of kernel_bodies.h) compiles unchanged with g++ and runs on the CPU:
// qualifiers vanish, the vector types become structs, the built-in index
// variables are set per emulated thread by RunGrid, and __syncthreads is a
// barrier of the emulated block. Host-only: nvcc has the real thing. Needs
// no CUDA header, so it builds where there is no toolkit.
//
// What the emulation proves is the kernels' logic (indexing, task lookup,
// tails, rank slots, barriers, the reduction tree) and the alignment of their
// vector accesses (build with -fsanitize=alignment: the vector types carry
// CUDA's 16-byte alignment). It does not prove the device's memory model,
// timing, or the device compiler's arithmetic.
#pragma once

#if defined(__CUDACC__)
#error "kernels/cuda/emulation.h is for the host compiler"
#endif

#include <cstdint>

#include "absl/functional/function_ref.h"

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
// RunGrid runs one block at a time, all its threads on the calling host
// thread, so a block's shared memory is a function-local static (one per
// host thread, so that grids on two host threads stay apart). Unlike the
// device's, it keeps the previous block's values rather than garbage.
#define __shared__ static thread_local

// may_alias: the kernels read and write float and uint16_t arrays through
// these, which CUDA allows and C++'s aliasing rules would not.
struct __attribute__((aligned(16), may_alias)) float4 {
  float x, y, z, w;
};
struct __attribute__((aligned(16), may_alias)) uint4 {
  unsigned x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
};
// The running emulated thread's coordinates, set by RunGrid.
inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

// Waits until every thread of the block has arrived. Every thread must reach
// it: RunGrid aborts, naming the block, when some thread of a block ends
// while others wait (the device would hang or corrupt the block).
void __syncthreads();

namespace shardopt::cuda::emulation {

// Runs `thread` once per thread of a one-dimensional grid, with the built-in
// variables set. Blocks run one after another. A block's threads run as
// fibers on the calling thread, in lockstep phases: each runs until it
// reaches __syncthreads or ends, then the next; once all have, the next
// phase starts. Aborts on a configuration the device refuses to launch.
void RunGrid(uint32_t blocks, uint32_t threads, absl::FunctionRef<void()> thread);

// `kernel<<<blocks, threads>>>(args...)`, run by RunGrid.
template <typename... Args>
void RunKernel(void (*kernel)(Args...), uint32_t blocks, uint32_t threads, const Args&... args) {
  RunGrid(blocks, threads, [&] { kernel(args...); });
}

}  // namespace shardopt::cuda::emulation
