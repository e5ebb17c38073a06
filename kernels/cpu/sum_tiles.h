// A running sum on the CPU (a layout of one fp32 gradient slot: the server's
// RunningSum folds every rank into it), tile by tile (kTile elements):
// - A tile that holds one rank's bf16 gradient keeps it as those bf16
//   values, 2 B an element in the first half of the tile's fp32 room. The
//   first fold is then a copy of half the bytes, and the update and the norm
//   widen as they read; widening is exact, so they see the same floats. A
//   second rank's fold widens the tile in place first.
// - A tile's sum of squares can be taken when the server says the tile is
//   final (Done), while it is hot in the caches, for the norm at the
//   barrier; the same fixed tree, so the same double.
// A tile's first rank fills it whole, with one dtype, before any other rank
// folds into it (server/running_sum.h): what keeping it bf16 relies on.
//
// Not thread-safe: its job's lock guards it; readers may run at once.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "kernels/cpu/loops.h"

namespace shardopt::cpu {

class SumTiles {
 public:
  // Over `numel` fp32 elements at `slot`, which outlives it.
  SumTiles(uint64_t numel, char* slot, const LoopTable* loops);
  // What it keeps besides the slot, for the memory budget.
  static uint64_t BookkeepingBytes(uint64_t numel);

  // JobState::AccumulateGrad's fold of `runs` (whole `dtype` elements at
  // any address) from element `offset` on.
  void Fold(uint64_t offset, DType dtype, absl::Span<const absl::string_view> runs, bool first);
  // The elements [offset, offset + count), whole tiles, are final this step.
  void Done(uint64_t offset, uint64_t count);
  // The elements were written otherwise than by Fold (fp32 values, in place).
  void Forget(uint64_t offset, uint64_t count);

  // Tile t's sum of squares by adamw_math.h's fixed tree.
  double Sumsq(uint64_t t) const;
  // Tile t's gradient as the update reads it: where it is, and its dtype.
  const void* Grad(uint64_t t, DType* dtype) const;

 private:
  uint64_t Length(uint64_t t) const;
  double Tree(uint64_t t) const;  // computed now
  char* Room(uint64_t t) const { return slot_ + t * kTile * 4; }
  void FoldTile(uint64_t t, uint64_t at, DType dtype, const char* src, uint64_t n, bool first);

  const uint64_t numel_;
  char* const slot_;
  const LoopTable* const loops_;
  std::vector<uint8_t> bf16_;    // [tile]: holds one rank's bf16 values
  std::vector<uint8_t> summed_;  // [tile]: sumsq_ is taken
  std::vector<double> sumsq_;
};

}  // namespace shardopt::cpu
