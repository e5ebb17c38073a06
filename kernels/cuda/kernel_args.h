// What the host hands the device kernels: plain data, shared by the host code
// and nvcc, with neither CUDA nor absl in it.
#pragma once

#include <cstdint>

#include "kernels/adamw_math.h"

namespace shardopt::cuda {

inline constexpr int kThreads = 256;  // per block, for both kernels
inline constexpr int kVec = 8;        // elements per 16-byte bf16 access (two float4 for fp32)
// The update's unit of work: one block updates one chunk of one shard, so a
// launch covers any mix of tensors (multi_tensor_apply's scheme).
inline constexpr uint64_t kChunk = uint64_t{kThreads} * kVec * 8;
// The reduction's unit is adamw_math.h's block, so one CUDA block computes
// one partial of the fixed tree, lane for lane.
static_assert(math::kSumsqLanes == kThreads, "one thread per lane of the sum-of-squares tree");
inline constexpr uint64_t kReduceUnit = math::kSumsqBlock;

// One contiguous range of one shard, as seen by a launch. Every pointer is
// 256-byte aligned plus a whole number of units, so the kernels' 16-byte
// accesses are aligned; only the range's tail goes element by element.
struct Task {
  const void* grad;      // this range in the first rank's slot; bf16 or fp32
  uint64_t slot_stride;  // bytes from one rank's slot to the next
  void* p;               // float or bf16 bits, per the launch's precision
  void* m;
  void* v;
  uint16_t* param_out;
  uint64_t numel;
  uint64_t first_unit;  // the launch's index of this range's first chunk or reduction block
  uint32_t rank_begin;  // into the launch's rank list, ascending ranks
  uint32_t rank_count;
  math::AdamWScalars scalars;
};

struct Launch {
  const Task* tasks;  // sorted by first_unit
  const uint32_t* ranks;
  uint32_t task_count;
  uint32_t unit_count;  // blocks in the grid
  bool bf16_grads;
  bool bf16_state;   // the update only
  double* partials;  // the reduction only: one per unit
};

}  // namespace shardopt::cuda
