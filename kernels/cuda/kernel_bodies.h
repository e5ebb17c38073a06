// The device kernels, compiled unchanged by nvcc (kernels.cu, which launches
// them) and by the host compiler under kernels/cuda/emulation.h (the host
// emulation that the tests run without a GPU). Include one of those first:
// this file uses CUDA's qualifiers, vector types and built-in variables.
#pragma once

#include <cstdint>

#include "kernels/adamw_math.h"
#include "kernels/cuda/kernel_args.h"

namespace shardopt::cuda {
namespace {

// Element access in the two storage types; all conversions are adamw_math.h's.
__device__ __forceinline__ float Load(const float* src) { return *src; }
__device__ __forceinline__ float Load(const uint16_t* src) { return math::bf16_to_float(*src); }
__device__ __forceinline__ void Store(float* dst, float x) { *dst = x; }
__device__ __forceinline__ void Store(uint16_t* dst, float x) { *dst = math::float_to_bf16(x); }

// kVec consecutive elements from a 16-byte-aligned address.
__device__ __forceinline__ void Load8(const float* src, float (&x)[kVec]) {
  const float4 a = reinterpret_cast<const float4*>(src)[0];
  const float4 b = reinterpret_cast<const float4*>(src)[1];
  x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w;
  x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}
__device__ __forceinline__ void Load8(const uint16_t* src, float (&x)[kVec]) {
  const uint4 u = *reinterpret_cast<const uint4*>(src);
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {  // little-endian: the lower half is the earlier element
    x[2 * i] = math::bf16_to_float(static_cast<uint16_t>(w[i] & 0xFFFFu));
    x[2 * i + 1] = math::bf16_to_float(static_cast<uint16_t>(w[i] >> 16));
  }
}
__device__ __forceinline__ void Store8(float* dst, const float (&x)[kVec]) {
  reinterpret_cast<float4*>(dst)[0] = make_float4(x[0], x[1], x[2], x[3]);
  reinterpret_cast<float4*>(dst)[1] = make_float4(x[4], x[5], x[6], x[7]);
}
__device__ __forceinline__ void Store8(uint16_t* dst, const float (&x)[kVec]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[i] = uint32_t{math::float_to_bf16(x[2 * i])} | uint32_t{math::float_to_bf16(x[2 * i + 1])} << 16;
  }
  *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
}

// The task whose units hold `unit`: the last one starting at or before it.
// Every thread searches alike, so the loads are broadcasts and need no sync.
__device__ __forceinline__ const Task& FindTask(const Launch& launch, uint32_t unit) {
  uint32_t lo = 0, hi = launch.task_count;
  while (hi - lo > 1) {
    const uint32_t mid = (lo + hi) / 2;
    if (launch.tasks[mid].first_unit <= unit) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return launch.tasks[lo];
}

// The aggregated gradient: the first listed rank's value, then += each next
// one in rank order, in fp32, as the CPU backend sums its tiles.
template <typename GradT>
class GradSlots {
 public:
  __device__ GradSlots(const Task& t, const uint32_t* ranks)
      : base_(static_cast<const char*>(t.grad)), stride_(t.slot_stride),
        ranks_(ranks + t.rank_begin), count_(t.rank_count) {}

  __device__ float At(uint64_t i) const {
    float g = Load(Slot(0) + i);
    for (uint32_t k = 1; k < count_; ++k) g = math::add(g, Load(Slot(k) + i));
    return g;
  }
  __device__ void At8(uint64_t i, float (&g)[kVec]) const {
    Load8(Slot(0) + i, g);
    for (uint32_t k = 1; k < count_; ++k) {
      float h[kVec];
      Load8(Slot(k) + i, h);
#pragma unroll
      for (int j = 0; j < kVec; ++j) g[j] = math::add(g[j], h[j]);
    }
  }

 private:
  __device__ const GradT* Slot(uint32_t k) const {
    return reinterpret_cast<const GradT*>(base_ + ranks_[k] * stride_);
  }

  const char* base_;
  uint64_t stride_;
  const uint32_t* ranks_;
  uint32_t count_;
};

// A cap of two resident blocks per SM (at most 128 registers) leaves 16 warps
// of 16-byte loads in flight, plenty for a streaming kernel; any tighter cap
// makes ptxas spill around the IEEE div and sqrt slow-path calls, which
// -warn-spills turns into a build error.
template <typename GradT, typename StateT>
__global__ void __launch_bounds__(kThreads, 2) UpdateKernel(const Launch launch) {
  const Task& t = FindTask(launch, blockIdx.x);
  const GradSlots<GradT> grads(t, launch.ranks);
  StateT* __restrict__ p = static_cast<StateT*>(t.p);
  StateT* __restrict__ m = static_cast<StateT*>(t.m);
  StateT* __restrict__ v = static_cast<StateT*>(t.v);
  uint16_t* __restrict__ out = t.param_out;
  const math::AdamWScalars s = t.scalars;
  const uint64_t begin = (blockIdx.x - t.first_unit) * kChunk;
  const uint64_t end = begin + kChunk < t.numel ? begin + kChunk : t.numel;
#pragma unroll 1  // unrolling would double the live registers, not the loads in flight
  for (uint64_t i = begin + threadIdx.x * kVec; i < end; i += kThreads * kVec) {
    if (i + kVec <= end) {
      float g[kVec], pf[kVec], mf[kVec], vf[kVec];
      grads.At8(i, g);
      Load8(p + i, pf);
      Load8(m + i, mf);
      Load8(v + i, vf);
#pragma unroll
      for (int j = 0; j < kVec; ++j) math::adamw_update(g[j], pf[j], mf[j], vf[j], s);
      Store8(p + i, pf);
      Store8(m + i, mf);
      Store8(v + i, vf);
      Store8(out + i, pf);
    } else {  // the shard's last elements, fewer than kVec
      for (uint64_t j = i; j < end; ++j) {
        float pf = Load(p + j), mf = Load(m + j), vf = Load(v + j);
        math::adamw_update(grads.At(j), pf, mf, vf, s);
        Store(p + j, pf);
        Store(m + j, mf);
        Store(v + j, vf);
        Store(out + j, pf);
      }
    }
  }
}

template <typename GradT>
__global__ void __launch_bounds__(kThreads) ReduceKernel(const Launch launch) {
  __shared__ double lanes[kThreads];
  const Task& t = FindTask(launch, blockIdx.x);
  const GradSlots<GradT> grads(t, launch.ranks);
  const uint64_t begin = (blockIdx.x - t.first_unit) * kReduceUnit;
  const uint64_t n = t.numel - begin < kReduceUnit ? t.numel - begin : kReduceUnit;
  double lane = 0.0;
  for (uint64_t i = threadIdx.x; i < n; i += kThreads) lane += math::square(grads.At(begin + i));
  lanes[threadIdx.x] = lane;
  __syncthreads();
  for (unsigned stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) lanes[threadIdx.x] += lanes[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) launch.partials[blockIdx.x] = lanes[0];
}

// The kernel each launch runs, on a grid of one kThreads block per unit.
// Host code, shared by both launchers so that they pick alike.
using Kernel = void (*)(Launch);
inline Kernel UpdateKernelFor(const Launch& launch) {
  return launch.bf16_grads ? (launch.bf16_state ? UpdateKernel<uint16_t, uint16_t> : UpdateKernel<uint16_t, float>)
                           : (launch.bf16_state ? UpdateKernel<float, uint16_t> : UpdateKernel<float, float>);
}
inline Kernel ReduceKernelFor(const Launch& launch) {
  return launch.bf16_grads ? ReduceKernel<uint16_t> : ReduceKernel<float>;
}

}  // namespace
}  // namespace shardopt::cuda
