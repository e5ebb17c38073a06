// Included once per instruction set by loops_<isa>.cc, each compiled with its
// own -m flags, inside a namespace of its own. Plain loops that the compiler
// vectorizes: no intrinsics, so the arithmetic stays adamw_math.h's.
#ifndef SHARDOPT_LOOPS_NAMESPACE
#error "define SHARDOPT_LOOPS_NAMESPACE before including loops_impl.h"
#endif

#include "kernels/cpu/loops.h"

namespace shardopt::cpu::SHARDOPT_LOOPS_NAMESPACE {
namespace {

inline float Load(float x) { return x; }
inline float Load(uint16_t x) { return math::bf16_to_float(x); }
inline void Store(float& dst, float x) { dst = x; }
inline void Store(uint16_t& dst, float x) { dst = math::float_to_bf16(x); }

// The update spends most of its cycles in the divider (a sqrt and two
// divisions per element), and the out-of-order window then no longer reaches
// far enough ahead to keep enough misses in flight: on a 2-vCPU AVX2 EPYC
// the update ran at about 0.8 of the stream loop without this and 0.9-0.95
// with it (on a later EPYC VM, 0.82-0.86 with or without it, at any
// distance from 512 to 2048: docs/measurements.md). The stream loop, with
// nothing to stall it, does not gain from it.
// Prefetching changes no result.
constexpr uint64_t kPrefetchBlock = 64;   // elements per round of prefetches
constexpr uint64_t kPrefetchAhead = 512;  // elements ahead of the block being updated

// A prefetch never faults, so running past the tile's end is harmless, and
// it primes the next tile, which is usually adjacent.
template <typename T>
inline void PrefetchBlockAhead(const T* base) {
  const uintptr_t ahead = reinterpret_cast<uintptr_t>(base) + kPrefetchAhead * sizeof(T);
  for (uintptr_t b = 0; b < kPrefetchBlock * sizeof(T); b += 64) {
    __builtin_prefetch(reinterpret_cast<const void*>(ahead + b));
  }
}

template <typename GradT, typename StateT>
void UpdateLoop(const GradT* __restrict grad, StateT* __restrict p, StateT* __restrict m,
                StateT* __restrict v, uint16_t* __restrict out, uint64_t n,
                const math::AdamWScalars scalars) {
  for (uint64_t block = 0; block < n; block += kPrefetchBlock) {
    PrefetchBlockAhead(grad + block);
    PrefetchBlockAhead(p + block);
    PrefetchBlockAhead(m + block);
    PrefetchBlockAhead(v + block);
    PrefetchBlockAhead(out + block);
    const uint64_t end = n - block < kPrefetchBlock ? n : block + kPrefetchBlock;
    for (uint64_t i = block; i < end; ++i) {
      float pf = Load(p[i]);
      float mf = Load(m[i]);
      float vf = Load(v[i]);
      math::adamw_update(Load(grad[i]), pf, mf, vf, scalars);
      Store(p[i], pf);
      Store(m[i], mf);
      Store(v[i], vf);
      out[i] = math::float_to_bf16(pf);
    }
  }
}

template <typename GradT>
void UpdateWithGrad(const UpdateArgs& a, const GradT* grad) {
  if (a.precision == Precision::kFp32) {
    UpdateLoop(grad, static_cast<float*>(a.p), static_cast<float*>(a.m),
               static_cast<float*>(a.v), a.param_out, a.n, a.scalars);
  } else {
    UpdateLoop(grad, static_cast<uint16_t*>(a.p), static_cast<uint16_t*>(a.m),
               static_cast<uint16_t*>(a.v), a.param_out, a.n, a.scalars);
  }
}

void Update(const UpdateArgs& a) {
  if (a.grad_dtype == DType::kFp32) {
    UpdateWithGrad(a, static_cast<const float*>(a.grad));
  } else {
    UpdateWithGrad(a, static_cast<const uint16_t*>(a.grad));
  }
}

// A gradient's source may sit at any address (a received message's piece),
// so its elements are read with LoadAsFloat (kernels/backend.h), a memcpy
// that is defined at any address and still vectorizes to unaligned loads.
// (Read through `const float*` they were undefined behaviour, which
// tests/loops_alignment_test.cc stops at.)
template <DType kDType>
void AccumulateTyped(float* __restrict acc, const char* __restrict src, uint64_t n, bool first) {
  if (first) {
    for (uint64_t i = 0; i < n; ++i) acc[i] = LoadAsFloat(src, i, kDType);
  } else {
    for (uint64_t i = 0; i < n; ++i) acc[i] = math::add(acc[i], LoadAsFloat(src, i, kDType));
  }
}

void Accumulate(float* acc, const void* src, DType dtype, uint64_t n, bool first) {
  const auto* bytes = static_cast<const char*>(src);
  if (dtype == DType::kFp32) {
    AccumulateTyped<DType::kFp32>(acc, bytes, n, first);
  } else {
    AccumulateTyped<DType::kBf16>(acc, bytes, n, first);
  }
}

template <typename T>
double SumsqBlockOf(const T* __restrict g, uint64_t n) {
  double lanes[math::kSumsqLanes] = {};
  for (uint64_t base = 0; base < n; base += math::kSumsqLanes) {
    const uint64_t width = n - base < math::kSumsqLanes ? n - base : math::kSumsqLanes;
    for (uint64_t l = 0; l < width; ++l) lanes[l] += math::square(Load(g[base + l]));
  }
  for (int stride = math::kSumsqLanes / 2; stride > 0; stride /= 2) {
    for (int l = 0; l < stride; ++l) lanes[l] += lanes[l + stride];
  }
  return lanes[0];
}

double SumsqBlock(const float* g, uint64_t n) { return SumsqBlockOf(g, n); }
// Widening is exact, so the bf16 values' squares are the widened ones'.
double SumsqBlockBf16(const uint16_t* g, uint64_t n) { return SumsqBlockOf(g, n); }

void Stream(const StreamArgs& a) {
  const uint16_t* __restrict grad = a.grad;
  float* __restrict p = a.p;
  float* __restrict m = a.m;
  float* __restrict v = a.v;
  uint16_t* __restrict out = a.param_out;
  for (uint64_t i = 0; i < a.n; ++i) {
    const float g = Load(grad[i]);
    const float pf = p[i] + g;
    p[i] = pf;
    m[i] = m[i] + g;
    v[i] = v[i] + g;
    out[i] = static_cast<uint16_t>(math::float_to_bits(pf) >> 16);
  }
}

}  // namespace

extern const LoopTable kLoops;
const LoopTable kLoops = {&Update, &Accumulate, &SumsqBlock, &SumsqBlockBf16, &Stream};

}  // namespace shardopt::cpu::SHARDOPT_LOOPS_NAMESPACE
