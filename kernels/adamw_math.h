// The per-element numerics of shardopt, compiled by both the host compiler and
// nvcc. The contract of docs/design.md (section 3) lives here and nowhere
// else: every backend calls these functions, which is what makes CPU and CUDA
// bitwise equal.
//
// Contraction into FMA would change the bits, so the device path spells each
// operation as a round-to-nearest intrinsic (nvcc never fuses those), and the
// host build compiles with -ffp-contract=off.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define SHARDOPT_HD __host__ __device__ __forceinline__
#else
#define SHARDOPT_HD inline __attribute__((always_inline))
#endif

namespace shardopt::math {

SHARDOPT_HD float add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
SHARDOPT_HD float sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
SHARDOPT_HD float mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
SHARDOPT_HD float div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
SHARDOPT_HD float sqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

SHARDOPT_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}
SHARDOPT_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// bf16 is the top half of an fp32. Widening is exact.
SHARDOPT_HD float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t{h} << 16); }

// Round to nearest, ties to even. Overflow becomes Inf as IEEE requires;
// subnormals round like any other value. A NaN keeps its sign and top payload
// bits and is forced quiet, so it can never round into an Inf.
SHARDOPT_HD uint16_t float_to_bf16(float f) {
  const uint32_t u = float_to_bits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>(f != f ? quiet_nan : rounded);
}

// The per-step constants of one tensor's update, computed on the host in
// double and rounded to float once (see step_scalars.h).
struct AdamWScalars {
  float gscale;           // loss-scale, 1/world_size and clip factor
  float decay;            // 1 - lr*wd
  float one_minus_beta1;  // 1 - β1
  float beta2;            // β2
  float one_minus_beta2;  // 1 - β2
  float bc2_sqrt;         // sqrt(1 - β2^t)
  float step_size;        // lr / (1 - β1^t)
  float eps;              // ε
  float beta1;            // 1 - one_minus_beta1, in float (exact): torch's lerp's 1 - weight
};

// One element of AdamW, in exactly the order of docs/design.md, section 3.1.
// `grad` is the aggregated (summed over ranks) gradient before scaling.
SHARDOPT_HD void adamw_update(float grad, float& p, float& m, float& v, const AdamWScalars& s) {
  const float g = mul(grad, s.gscale);
  p = mul(p, s.decay);
  // torch's lerp(m, g, w) for w = 1 - β1: from m for w < 0.5, from g
  // otherwise, where m + w*(g - m) would cancel m's small values away (with
  // β1 = 0, g = 1e-6 after g = 100 gave m = 0 rather than 1e-6). One branch
  // for the whole call: w is the same for every element.
  m = s.one_minus_beta1 < 0.5f ? add(m, mul(s.one_minus_beta1, sub(g, m))) : sub(g, mul(sub(g, m), s.beta1));
  v = add(mul(v, s.beta2), mul(mul(s.one_minus_beta2, g), g));
  const float d = add(div(sqrt(v), s.bc2_sqrt), s.eps);
  p = sub(p, mul(s.step_size, div(m, d)));
}

// The squared-norm reduction is a fixed tree so that every backend and every
// thread count gives the same double: a shard is cut into blocks of
// kSumsqBlock elements from its start; in a block, lane l sums the squares of
// elements l, l+kSumsqLanes, ... in order; the lanes are then folded pairwise,
// halving the stride. Blocks, then shards, are summed in order.
inline constexpr int kSumsqLanes = 256;
inline constexpr int kSumsqBlock = 4096;

SHARDOPT_HD double square(float g) {
  const double d = static_cast<double>(g);
#if defined(__CUDA_ARCH__)
  return __dmul_rn(d, d);
#else
  return d * d;  // exact: a float's square fits a double's mantissa
#endif
}

}  // namespace shardopt::math
