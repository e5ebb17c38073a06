#include "kernels/cuda/launch_plan.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace shardopt::cuda {
namespace {

// Every buffer starts on this boundary (ShardPlacement).
constexpr uint64_t kAlign = 256;
// A launch's grid is at most this many blocks.
constexpr uint64_t kMaxUnits = INT_MAX;

constexpr uint64_t RoundUp(uint64_t x, uint64_t to) { return (x + to - 1) / to * to; }

// A launch table: the tasks, then the ranks they index.
constexpr uint64_t RanksAt(uint64_t tasks) { return RoundUp(tasks * sizeof(Task), 16); }
constexpr uint64_t TableBytes(uint64_t tasks, uint64_t ranks) { return RanksAt(tasks) + ranks * sizeof(uint32_t); }

// Lays buffers out in the arena; a size past 2^64 bytes marks the plan
// impossible instead of wrapping.
class Allocator {
 public:
  // Reserves count*elem_bytes bytes and returns their offset.
  uint64_t Take(uint64_t count, uint64_t elem_bytes) {
    const uint64_t start = bytes_;
    overflow_ |= __builtin_add_overflow(start, AlignedSize(count, elem_bytes), &bytes_);
    return start;
  }
  uint64_t AlignedSize(uint64_t count, uint64_t elem_bytes) {
    uint64_t bytes = 0;
    overflow_ |= __builtin_mul_overflow(count, elem_bytes, &bytes) || bytes > UINT64_MAX - kAlign;
    return RoundUp(bytes, kAlign);
  }
  bool overflow() const { return overflow_; }
  uint64_t bytes() const { return bytes_; }

 private:
  uint64_t bytes_ = 0;
  bool overflow_ = false;
};

struct Batch {
  std::vector<Task> tasks;
  std::vector<uint32_t> ranks;
  uint64_t units = 0;
};

TableImage ImageOf(const Batch& batch) {
  TableImage image(TableBytes(batch.tasks.size(), batch.ranks.size()));
  std::memcpy(image.data(), batch.tasks.data(), batch.tasks.size() * sizeof(Task));
  std::memcpy(image.data() + RanksAt(batch.tasks.size()), batch.ranks.data(), batch.ranks.size() * sizeof(uint32_t));
  return image;
}

}  // namespace

uint64_t ShardPlacement::StateOffset(StateKind kind) const {
  switch (kind) {
    case StateKind::kMaster: return p;
    case StateKind::kExpAvg: return m;
    case StateKind::kExpAvgSq: return v;
    case StateKind::kParamBf16: return param_out;
  }
  return p;
}

absl::StatusOr<ArenaPlan> ArenaPlan::Create(const JobLayout& layout, uint64_t slot_bytes) {
  const uint64_t world = layout.world_size;
  if (TableBytes(1, world) > slot_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size ", world, " is too large for one launch's rank list on the GPU"));
  }
  ArenaPlan plan(layout);
  const uint64_t grad_bytes = DTypeSize(layout.grad_dtype);
  Allocator alloc;
  uint64_t reduce_units = 0;
  for (const ShardLayout& sl : layout.shards) {
    ShardPlacement s;
    s.layout = sl;
    s.state_elem_bytes = sl.precision == Precision::kFp32 ? 4 : 2;
    s.p = alloc.Take(sl.numel, s.state_elem_bytes);
    s.m = alloc.Take(sl.numel, s.state_elem_bytes);
    s.v = alloc.Take(sl.numel, s.state_elem_bytes);
    s.param_out = alloc.Take(sl.numel, 2);
    s.slot_stride = alloc.AlignedSize(sl.numel, grad_bytes);
    s.grads = alloc.Take(world, s.slot_stride);
    plan.state_bytes_ += 3 * sl.numel * s.state_elem_bytes;
    reduce_units += (sl.numel + kReduceUnit - 1) / kReduceUnit;
    plan.shards_.push_back(s);
  }
  const uint64_t shard_count = plan.shards_.size();
  plan.table_capacity_ = std::min(slot_bytes, TableBytes(shard_count, shard_count * world));
  plan.table_ = alloc.Take(plan.table_capacity_, 1);
  plan.partials_capacity_ = std::min(reduce_units, slot_bytes / sizeof(double));
  plan.partials_ = alloc.Take(plan.partials_capacity_, sizeof(double));
  if (alloc.overflow()) return absl::ResourceExhaustedError("the job needs more than 2^64 bytes of device memory");
  plan.bytes_ = alloc.bytes();
  return plan;
}

absl::Status ArenaPlan::ForEachBatch(char* arena, absl::Span<const Work> work, uint64_t unit, uint64_t max_units,
                                     bool bf16_state, LaunchFn launch) const {
  auto run = [&](const Batch& batch) {
    Launch l;
    l.tasks = reinterpret_cast<const Task*>(arena + table_);
    l.ranks = reinterpret_cast<const uint32_t*>(arena + table_ + RanksAt(batch.tasks.size()));
    l.task_count = static_cast<uint32_t>(batch.tasks.size());
    l.unit_count = static_cast<uint32_t>(batch.units);
    l.bf16_grads = layout_.grad_dtype == DType::kBf16;
    l.bf16_state = bf16_state;
    l.partials = reinterpret_cast<double*>(arena + partials_);
    return launch(ImageOf(batch), l);
  };
  const uint64_t grad_bytes = DTypeSize(layout_.grad_dtype);
  Batch batch;
  for (const Work& w : work) {
    const ShardPlacement& s = shards_[w.grads->shard];
    const std::vector<uint32_t>& ranks = w.grads->ranks;
    for (uint64_t begin = w.begin; begin < w.end;) {
      if (batch.units == max_units ||
          TableBytes(batch.tasks.size() + 1, batch.ranks.size() + ranks.size()) > table_capacity_) {
        SHARDOPT_RETURN_IF_ERROR(run(batch));
        batch = Batch{};
      }
      const uint64_t len = std::min(w.end - begin, (max_units - batch.units) * unit);
      const uint64_t se = s.state_elem_bytes;
      Task t;
      t.grad = arena + s.grads + begin * grad_bytes;
      t.slot_stride = s.slot_stride;
      t.p = arena + s.p + begin * se;
      t.m = arena + s.m + begin * se;
      t.v = arena + s.v + begin * se;
      t.param_out = reinterpret_cast<uint16_t*>(arena + s.param_out) + begin;
      t.numel = len;
      t.first_unit = batch.units;
      t.rank_begin = static_cast<uint32_t>(batch.ranks.size());
      t.rank_count = static_cast<uint32_t>(ranks.size());
      t.scalars = w.scalars != nullptr ? *w.scalars : math::AdamWScalars{};
      batch.tasks.push_back(t);
      batch.ranks.insert(batch.ranks.end(), ranks.begin(), ranks.end());
      batch.units += (len + unit - 1) / unit;
      begin += len;
    }
  }
  return batch.tasks.empty() ? absl::OkStatus() : run(batch);
}

static_assert(kApplyAlignment % kChunk == 0, "a partial update must start on a chunk boundary");

absl::Status ArenaPlan::ForEachUpdate(char* arena, absl::Span<const ShardStep> steps, LaunchFn launch) const {
  std::vector<uint64_t> ends;
  for (const ShardStep& step : steps) {
    SHARDOPT_ASSIGN_OR_RETURN(auto end, CheckShardStep(layout_, step));
    ends.push_back(end);
  }
  for (const Precision precision : {Precision::kFp32, Precision::kBf16}) {
    std::vector<Work> work;
    for (size_t i = 0; i < steps.size(); ++i) {
      if (shards_[steps[i].grads.shard].layout.precision == precision) {
        work.push_back({&steps[i].grads, &steps[i].scalars, steps[i].offset, ends[i]});
      }
    }
    SHARDOPT_RETURN_IF_ERROR(ForEachBatch(arena, work, kChunk, kMaxUnits, precision == Precision::kBf16, launch));
  }
  return absl::OkStatus();
}

absl::Status ArenaPlan::ForEachReduce(char* arena, absl::Span<const ShardGrads> shards, LaunchFn launch) const {
  std::vector<Work> work;
  for (const ShardGrads& sg : shards) {
    SHARDOPT_RETURN_IF_ERROR(CheckShardGrads(layout_, sg));
    work.push_back({&sg, nullptr, 0, shards_[sg.shard].layout.numel});
  }
  return ForEachBatch(arena, work, kReduceUnit, std::min(partials_capacity_, kMaxUnits), false, launch);
}

GradStats PartialsSum::stats() const {
  GradStats stats;
  stats.sum_squares = sum_;
  stats.nonfinite = !std::isfinite(sum_);
  return stats;
}

}  // namespace shardopt::cuda
