// Where a CUDA job's buffers lie in its device arena, and how its work is cut
// into kernel launches: pure functions of the layout and the arena's base
// address, with no CUDA runtime in them, so that the host emulation of the
// kernels (emulated_kernels.h) runs exactly the launches the device runs.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "kernels/cuda/kernel_args.h"

namespace shardopt::cuda {

// One slot of the device's pinned host staging (Device::kSlotBytes): a
// launch's table and its reduction partials each travel through one.
inline constexpr uint64_t kStagingSlotBytes = uint64_t{4} << 20;

// One shard's buffers: byte offsets into the arena, each 256-byte aligned,
// so that a unit-aligned range of any element type is 16-byte aligned for
// the kernels' vector accesses.
struct ShardPlacement {
  ShardLayout layout;
  uint64_t state_elem_bytes = 0;  // 4 for FP32, 2 for BF16
  uint64_t p = 0, m = 0, v = 0, param_out = 0, grads = 0;
  uint64_t slot_stride = 0;  // one rank's gradient slot, rounded up to keep every slot aligned

  uint64_t StateOffset(StateKind kind) const;  // master, m, v or the bf16 params
};

// A launch's table, as it must lie at the arena's table offset when the
// launch runs: the tasks, then the ranks they index.
using TableImage = std::vector<char>;
using LaunchFn = absl::FunctionRef<absl::Status(const TableImage& table, const Launch& launch)>;

class ArenaPlan {
 public:
  // `slot_bytes` bounds what one launch moves through host staging: its
  // table and its reduction partials. Fails with INVALID_ARGUMENT when one
  // task's rank list cannot fit, RESOURCE_EXHAUSTED past 2^64 bytes.
  static absl::StatusOr<ArenaPlan> Create(const JobLayout& layout, uint64_t slot_bytes);

  const JobLayout& layout() const { return layout_; }
  const ShardPlacement& shard(uint32_t index) const { return shards_[index]; }
  uint64_t bytes() const { return bytes_; }                          // the whole arena
  uint64_t state_bytes() const { return state_bytes_; }              // master, m and v of every shard
  uint64_t table() const { return table_; }                          // offset of every launch's table
  uint64_t table_capacity() const { return table_capacity_; }        // its bytes
  uint64_t partials() const { return partials_; }                    // offset of the reduction's partials
  uint64_t partials_capacity() const { return partials_capacity_; }  // their count

  // Checks every step, then calls `launch` for each fused-update launch over
  // them, in order. A launch holds one precision, as the kernel's state type
  // is a template parameter: FP32 shards' launches come first. `arena` is
  // the arena's (device) base address, only used to form pointers.
  absl::Status ForEachUpdate(char* arena, absl::Span<const ShardStep> steps, LaunchFn launch) const;
  // Checks every entry, then calls `launch` for each sum-of-squares launch.
  // Each writes launch.unit_count partials at partials(); taken in launch
  // order, they are the fixed tree's blocks, shard by shard in the order given.
  absl::Status ForEachReduce(char* arena, absl::Span<const ShardGrads> shards, LaunchFn launch) const;

 private:
  // One shard's range in a launch; the reduction has no scalars.
  struct Work {
    const ShardGrads* grads;
    const math::AdamWScalars* scalars;
    uint64_t begin;  // the shard's elements [begin, end)
    uint64_t end;
  };

  explicit ArenaPlan(JobLayout layout) : layout_(std::move(layout)) {}
  // Cuts `work` into launches of at most `max_units` units of `unit`
  // elements whose table fits the arena's, splitting a shard at a unit
  // boundary where it must.
  absl::Status ForEachBatch(char* arena, absl::Span<const Work> work, uint64_t unit, uint64_t max_units,
                            bool bf16_state, LaunchFn launch) const;

  JobLayout layout_;
  std::vector<ShardPlacement> shards_;
  uint64_t state_bytes_ = 0;
  uint64_t table_ = 0, table_capacity_ = 0;
  uint64_t partials_ = 0, partials_capacity_ = 0;
  uint64_t bytes_ = 0;
};

// The reduction's partials summed as the CPU backend sums its own blocks: in
// order, from 0.
class PartialsSum {
 public:
  void Add(absl::Span<const double> partials) {
    for (const double p : partials) sum_ += p;
  }
  GradStats stats() const;

 private:
  double sum_ = 0.0;
};

}  // namespace shardopt::cuda
