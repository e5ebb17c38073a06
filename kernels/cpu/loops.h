// The CPU's inner loops, compiled once per instruction set and chosen at run
// time, so one binary runs (and vectorizes) on AVX2-only and AVX-512 machines.
// Every variant computes the same bits: they differ only in vector width, and
// the math is adamw_math.h with contraction off.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/adamw_math.h"
#include "kernels/backend.h"

namespace shardopt::cpu {

enum class Isa { kGeneric, kAvx2, kAvx512 };
const char* IsaName(Isa isa);
// The widest variant this CPU runs, and every variant it can run.
Isa BestIsa();
std::vector<Isa> SupportedIsas();

// Gradients are aggregated over ranks in tiles of this many elements, the
// same as the squared-norm block, so each tile is one reduction block.
inline constexpr uint64_t kTile = math::kSumsqBlock;

struct UpdateArgs {
  const void* grad;  // fp32 or bf16, per grad_dtype
  DType grad_dtype;
  void* p;  // float or bf16 bits, per precision
  void* m;
  void* v;
  Precision precision;
  uint16_t* param_out;
  uint64_t n;
  math::AdamWScalars scalars;
};

struct StreamArgs {  // the roofline: the update's streams, trivial arithmetic
  const uint16_t* grad;
  float* p;
  float* m;
  float* v;
  uint16_t* param_out;
  uint64_t n;
};

struct LoopTable {
  void (*update)(const UpdateArgs& args);
  // acc[i] = src[i] when `first`, else acc[i] += src[i] (one fp32 add).
  // `src` may be at any address; `acc` is aligned to its floats.
  void (*accumulate)(float* acc, const void* src, DType dtype, uint64_t n, bool first);
  // One reduction block (n <= kSumsqBlock) by adamw_math.h's fixed tree.
  double (*sumsq_block)(const float* g, uint64_t n);
  // The same of bf16 values, widened as they are read.
  double (*sumsq_block_bf16)(const uint16_t* g, uint64_t n);
  void (*stream)(const StreamArgs& args);
};

const LoopTable& Loops(Isa isa);

}  // namespace shardopt::cpu
