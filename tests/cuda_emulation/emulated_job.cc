#include "tests/cuda_emulation/emulated_job.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/emulated_kernels.h"

namespace shardopt::testing {
namespace {

// cudaMalloc's alignment, which the plan's offsets build on.
constexpr uint64_t kBaseAlign = 256;
// Past the arena's end, where no launch may write.
constexpr uint64_t kGuardBytes = 4096;

constexpr StateKind kKinds[] = {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq, StateKind::kParamBf16};

}  // namespace

absl::StatusOr<std::unique_ptr<EmulatedCudaJob>> EmulatedCudaJob::Create(const JobLayout& layout, uint64_t slot_bytes) {
  auto plan = cuda::ArenaPlan::Create(layout, slot_bytes);
  if (!plan.ok()) return plan.status();
  return std::unique_ptr<EmulatedCudaJob>(new EmulatedCudaJob(*std::move(plan)));
}

EmulatedCudaJob::EmulatedCudaJob(cuda::ArenaPlan plan)
    : plan_(std::move(plan)),
      size_((plan_.bytes() + kGuardBytes + kBaseAlign - 1) / kBaseAlign * kBaseAlign),
      arena_(static_cast<char*>(std::aligned_alloc(kBaseAlign, size_)), &std::free) {
  // Padding, guard, and state until Put. Not a NaN: an update run from a NaN
  // writes that same NaN back, so a stray write would not show, while from
  // this value (-2.9e-16 as fp32 and as bf16) every update changes it.
  std::memset(arena_.get(), 0xA5, size_);
}

uint8_t* EmulatedCudaJob::Bytes(uint32_t shard, StateKind kind) const {
  return reinterpret_cast<uint8_t*>(arena_.get() + plan_.shard(shard).StateOffset(kind));
}

uint64_t EmulatedCudaJob::StoredBytes(uint32_t shard, StateKind kind) const {
  const cuda::ShardPlacement& s = plan_.shard(shard);
  return s.layout.numel * (kind == StateKind::kParamBf16 ? 2 : s.state_elem_bytes);
}

void EmulatedCudaJob::Put(uint32_t shard, StateKind kind, absl::Span<const uint8_t> stored) {
  if (stored.size() != StoredBytes(shard, kind)) std::abort();
  std::memcpy(Bytes(shard, kind), stored.data(), stored.size());
}

std::vector<uint8_t> EmulatedCudaJob::Get(uint32_t shard, StateKind kind) const {
  const uint8_t* at = Bytes(shard, kind);
  return std::vector<uint8_t>(at, at + StoredBytes(shard, kind));
}

void EmulatedCudaJob::PutGrad(uint32_t shard, uint32_t rank, absl::Span<const uint8_t> grad) {
  const cuda::ShardPlacement& s = plan_.shard(shard);
  if (grad.size() != s.layout.numel * DTypeSize(plan_.layout().grad_dtype) || rank >= plan_.layout().world_size) {
    std::abort();
  }
  std::memcpy(arena_.get() + s.grads + rank * s.slot_stride, grad.data(), grad.size());
}

void EmulatedCudaJob::PoisonParams(uint32_t shard, uint64_t begin, uint64_t end) {
  std::memset(Bytes(shard, StateKind::kParamBf16) + begin * 2, 0xFF, (end - begin) * 2);
}

absl::Status EmulatedCudaJob::Upload(const cuda::TableImage& table) {
  if (table.size() > plan_.table_capacity()) {
    return absl::InternalError(
        absl::StrCat("a table of ", table.size(), " bytes for a slot of ", plan_.table_capacity()));
  }
  std::memcpy(arena() + plan_.table(), table.data(), table.size());
  return absl::OkStatus();
}

std::string EmulatedCudaJob::Describe(uint64_t offset) const {
  for (uint32_t i = 0; i < plan_.layout().shards.size(); ++i) {
    const cuda::ShardPlacement& s = plan_.shard(i);
    for (const StateKind kind : kKinds) {
      const uint64_t at = s.StateOffset(kind);
      if (offset >= at && offset < at + StoredBytes(i, kind)) {
        return absl::StrCat("shard ", i, " ", StateKindName(kind), " byte ", offset - at);
      }
    }
    const uint64_t slots = s.grads + plan_.layout().world_size * s.slot_stride;
    if (offset >= s.grads && offset < slots) return absl::StrCat("shard ", i, " gradient slots");
  }
  return offset >= plan_.bytes() ? "the guard past the arena" : "padding";
}

absl::Status EmulatedCudaJob::CheckedRun(std::vector<Range> writable, absl::FunctionRef<absl::Status()> run) {
  writable.push_back({plan_.table(), plan_.table() + plan_.table_capacity()});
  writable.push_back({plan_.partials(), plan_.partials() + plan_.partials_capacity() * sizeof(double)});
  std::sort(writable.begin(), writable.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  const std::vector<char> before(arena_.get(), arena_.get() + size_);
  if (auto st = run(); !st.ok()) return st;
  // The gaps between the writable ranges must be as they were.
  uint64_t gap = 0;
  writable.push_back({size_, size_});
  for (const Range& r : writable) {
    if (r.begin > gap && std::memcmp(before.data() + gap, arena_.get() + gap, r.begin - gap) != 0) {
      uint64_t i = gap;
      while (before[i] == arena_.get()[i]) ++i;
      return absl::InternalError(absl::StrCat("a launch wrote arena byte ", i, " (", Describe(i), ")"));
    }
    gap = std::max(gap, r.end);
  }
  return absl::OkStatus();
}

absl::Status EmulatedCudaJob::Apply(absl::Span<const ShardStep> steps) {
  std::vector<Range> writable;
  for (const ShardStep& step : steps) {
    auto end = CheckShardStep(plan_.layout(), step);
    if (!end.ok()) return end.status();
    const cuda::ShardPlacement& s = plan_.shard(step.grads.shard);
    for (const StateKind kind : kKinds) {
      const uint64_t elem = kind == StateKind::kParamBf16 ? 2 : s.state_elem_bytes;
      writable.push_back({s.StateOffset(kind) + step.offset * elem, s.StateOffset(kind) + *end * elem});
    }
  }
  return CheckedRun(std::move(writable), [&] {
    return plan_.ForEachUpdate(arena(), steps, [&](const cuda::TableImage& table, const cuda::Launch& launch) {
      if (auto st = Upload(table); !st.ok()) return st;
      cuda::emulated::LaunchUpdate(launch);
      ++launches_;
      return absl::OkStatus();
    });
  });
}

absl::StatusOr<GradStats> EmulatedCudaJob::ReduceGrads(absl::Span<const ShardGrads> shards) {
  cuda::PartialsSum sum;
  auto st = CheckedRun({}, [&] {
    return plan_.ForEachReduce(arena(), shards, [&](const cuda::TableImage& table, const cuda::Launch& launch) {
      if (auto st = Upload(table); !st.ok()) return st;
      // NaN partials, so that a block that writes none shows.
      std::memset(launch.partials, 0xFF, plan_.partials_capacity() * sizeof(double));
      cuda::emulated::LaunchReduce(launch);
      ++launches_;
      sum.Add({launch.partials, launch.unit_count});
      return absl::OkStatus();
    });
  });
  if (!st.ok()) return st;
  return sum.stats();
}

}  // namespace shardopt::testing
