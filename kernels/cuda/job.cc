#include "kernels/cuda/job.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/kernels.h"

namespace shardopt::cuda {
namespace {

// Every buffer starts on this boundary, so a unit-aligned range of any
// element type is 16-byte aligned for the kernels' vector accesses.
constexpr uint64_t kAlign = 256;
// A launch's grid is at most this many blocks.
constexpr uint64_t kMaxUnits = INT_MAX;

constexpr uint64_t RoundUp(uint64_t x, uint64_t to) { return (x + to - 1) / to * to; }

// A launch table: the tasks, then the ranks they index.
constexpr uint64_t RanksAt(uint64_t tasks) { return RoundUp(tasks * sizeof(Task), 16); }
constexpr uint64_t TableBytes(uint64_t tasks, uint64_t ranks) { return RanksAt(tasks) + ranks * sizeof(uint32_t); }

// Lays buffers out in the arena; a size past 2^64 bytes marks the plan
// impossible instead of wrapping.
class ArenaPlan {
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

}  // namespace

absl::StatusOr<std::unique_ptr<CudaJobState>> CudaJobState::Create(std::shared_ptr<Device> device,
                                                                   const JobLayout& layout) {
  std::unique_ptr<CudaJobState> job(new CudaJobState(std::move(device), layout));
  if (auto st = job->Init(); !st.ok()) return st;  // whatever Init got is freed with `job`
  return job;
}

absl::Status CudaJobState::Init() {
  const uint64_t world = layout_.world_size;
  if (TableBytes(1, world) > Device::kSlotBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size ", world, " is too large for one launch's rank list on the GPU"));
  }
  const uint64_t grad_bytes = DTypeSize(layout_.grad_dtype);
  ArenaPlan plan;
  uint64_t reduce_units = 0;
  for (const ShardLayout& sl : layout_.shards) {
    Shard s;
    s.layout = sl;
    s.state_elem_bytes = sl.precision == Precision::kFp32 ? 4 : 2;
    s.p = plan.Take(sl.numel, s.state_elem_bytes);
    s.m = plan.Take(sl.numel, s.state_elem_bytes);
    s.v = plan.Take(sl.numel, s.state_elem_bytes);
    s.param_out = plan.Take(sl.numel, 2);
    s.slot_stride = plan.AlignedSize(sl.numel, grad_bytes);
    s.grads = plan.Take(world, s.slot_stride);
    state_bytes_ += 3 * sl.numel * s.state_elem_bytes;
    reduce_units += (sl.numel + kReduceUnit - 1) / kReduceUnit;
    shards_.push_back(s);
  }
  const uint64_t shard_count = shards_.size();
  table_capacity_ = std::min(Device::kSlotBytes, TableBytes(shard_count, shard_count * world));
  table_ = plan.Take(table_capacity_, 1);
  partials_capacity_ = std::min(reduce_units, Device::kSlotBytes / sizeof(double));
  partials_ = plan.Take(partials_capacity_, sizeof(double));
  if (plan.overflow()) return absl::ResourceExhaustedError("the job needs more than 2^64 bytes of device memory");
  arena_bytes_ = plan.bytes();

  if (auto st = device_->Enter(); !st.ok()) return st;
  size_t free = 0, total = 0;
  if (auto st = device_->Check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo"); !st.ok()) return st;
  if (arena_bytes_ > free) {
    return absl::ResourceExhaustedError(absl::StrCat("the job needs ", arena_bytes_, " bytes of device memory; ",
                                                     device_->description(), " has ", free, " free"));
  }
  if (auto st = device_->Check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
      !st.ok()) {
    return st;
  }
  if (arena_bytes_ == 0) return absl::OkStatus();
  if (auto st = device_->Check(cudaMalloc(&arena_, arena_bytes_), "cudaMalloc"); !st.ok()) return st;
  if (auto st = device_->Check(cudaMemsetAsync(arena_, 0, arena_bytes_, stream_), "cudaMemsetAsync"); !st.ok()) {
    return st;
  }
  return Sync();
}

CudaJobState::~CudaJobState() {
  if (stream_ == nullptr) return;
  // Queued copies and launches still use the arena and the staging slots.
  device_->Check(cudaSetDevice(device_->index()), "cudaSetDevice").IgnoreError();
  device_->Check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize").IgnoreError();
  if (arena_ != nullptr) device_->Check(cudaFree(arena_), "cudaFree").IgnoreError();
  device_->Check(cudaStreamDestroy(stream_), "cudaStreamDestroy").IgnoreError();
}

uint64_t CudaJobState::StateOffset(const Shard& s, StateKind kind) const {
  return kind == StateKind::kMaster ? s.p : kind == StateKind::kExpAvg ? s.m : s.v;
}

absl::Status CudaJobState::Sync() const {
  return device_->Check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
}

absl::Status CudaJobState::WriteGrad(uint32_t shard, uint32_t rank, uint64_t offset, DType dtype,
                                     const void* data, uint64_t count) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto st = device_->Enter(); !st.ok()) return st;
  if (auto st = CheckGradWrite(layout_, shard, rank, offset, dtype, count); !st.ok()) return st;
  const Shard& s = shards_[shard];
  const uint64_t esize = DTypeSize(layout_.grad_dtype);
  const DeviceArray dst{At(s.grads + rank * s.slot_stride + offset * esize), esize};
  const char* src = static_cast<const char*>(data);
  const bool widen = dtype != layout_.grad_dtype;  // bf16 into fp32 slots, on the host
  return device_->Upload(stream_, {&dst, 1}, count, [&](uint64_t first, uint64_t n, char* const* staged) {
    if (!widen) {
      std::memcpy(staged[0], src + first * esize, n * esize);
      return;
    }
    WidenBf16(reinterpret_cast<const uint16_t*>(src) + first, n, reinterpret_cast<float*>(staged[0]));
  });
}

absl::Status CudaJobState::WriteState(uint32_t shard, StateKind kind, uint64_t offset, DType dtype,
                                      const void* data, uint64_t count) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto st = device_->Enter(); !st.ok()) return st;
  if (auto st = CheckShardRange(layout_, shard, offset, count); !st.ok()) return st;
  if (kind == StateKind::kParamBf16) {
    return absl::InvalidArgumentError("bf16 params are derived from the master; write the master");
  }
  const Shard& s = shards_[shard];
  const bool fp32_state = s.layout.precision == Precision::kFp32;
  const bool master = kind == StateKind::kMaster;
  // Converted on the host, by the same adamw_math.h functions the CPU uses.
  const DeviceArray dsts[2] = {{At(StateOffset(s, kind) + offset * s.state_elem_bytes), s.state_elem_bytes},
                               {At(s.param_out + offset * 2), 2}};
  return device_->Upload(stream_, {dsts, master ? 2u : 1u}, count,
                         [&](uint64_t first, uint64_t n, char* const* staged) {
                           for (uint64_t i = 0; i < n; ++i) {
                             const float x =
                                 dtype == DType::kFp32
                                     ? static_cast<const float*>(data)[first + i]
                                     : math::bf16_to_float(static_cast<const uint16_t*>(data)[first + i]);
                             if (fp32_state) {
                               reinterpret_cast<float*>(staged[0])[i] = x;
                             } else {
                               reinterpret_cast<uint16_t*>(staged[0])[i] = math::float_to_bf16(x);
                             }
                             if (master) reinterpret_cast<uint16_t*>(staged[1])[i] = math::float_to_bf16(x);
                           }
                         });
}

absl::Status CudaJobState::ReadState(uint32_t shard, StateKind kind, uint64_t offset, uint64_t count,
                                     DType dtype, void* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto st = device_->Enter(); !st.ok()) return st;
  if (auto st = CheckShardRange(layout_, shard, offset, count); !st.ok()) return st;
  const Shard& s = shards_[shard];
  char* dst = static_cast<char*>(out);
  if (kind == StateKind::kParamBf16) {
    if (dtype != DType::kBf16) return absl::InvalidArgumentError("params are read as bf16");
    return device_->Download(stream_, {At(s.param_out + offset * 2), 2}, count,
                             [&](uint64_t first, uint64_t n, const char* staged) {
                               std::memcpy(dst + first * 2, staged, n * 2);
                             });
  }
  if (dtype != DType::kFp32) return absl::InvalidArgumentError("master, m and v are read as fp32");
  const bool fp32_state = s.layout.precision == Precision::kFp32;
  return device_->Download(stream_, {At(StateOffset(s, kind) + offset * s.state_elem_bytes), s.state_elem_bytes},
                           count, [&](uint64_t first, uint64_t n, const char* staged) {
                             if (fp32_state) {
                               std::memcpy(dst + first * 4, staged, n * 4);
                               return;
                             }
                             for (uint64_t i = 0; i < n; ++i) {
                               reinterpret_cast<float*>(dst)[first + i] =
                                   math::bf16_to_float(reinterpret_cast<const uint16_t*>(staged)[i]);
                             }
                           });
}

absl::Status CudaJobState::ForEachBatch(absl::Span<const Work> work, uint64_t unit, uint64_t max_units,
                                        absl::FunctionRef<absl::Status(const Batch&)> launch) const {
  const uint64_t grad_bytes = DTypeSize(layout_.grad_dtype);
  Batch batch;
  for (const Work& w : work) {
    const Shard& s = shards_[w.grads->shard];
    const std::vector<uint32_t>& ranks = w.grads->ranks;
    for (uint64_t begin = w.begin; begin < w.end;) {
      if (batch.units == max_units ||
          TableBytes(batch.tasks.size() + 1, batch.ranks.size() + ranks.size()) > table_capacity_) {
        if (auto st = launch(batch); !st.ok()) return st;
        batch = Batch{};
      }
      const uint64_t len = std::min(w.end - begin, (max_units - batch.units) * unit);
      const uint64_t se = s.state_elem_bytes;
      Task t;
      t.grad = At(s.grads + begin * grad_bytes);
      t.slot_stride = s.slot_stride;
      t.p = At(s.p + begin * se);
      t.m = At(s.m + begin * se);
      t.v = At(s.v + begin * se);
      t.param_out = reinterpret_cast<uint16_t*>(At(s.param_out)) + begin;
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
  return batch.tasks.empty() ? absl::OkStatus() : launch(batch);
}

absl::StatusOr<Launch> CudaJobState::UploadTable(const Batch& batch) const {
  const uint64_t ranks_at = RanksAt(batch.tasks.size());
  std::vector<char> image(TableBytes(batch.tasks.size(), batch.ranks.size()));
  std::memcpy(image.data(), batch.tasks.data(), batch.tasks.size() * sizeof(Task));
  std::memcpy(image.data() + ranks_at, batch.ranks.data(), batch.ranks.size() * sizeof(uint32_t));
  const DeviceArray dst{At(table_), 1};
  if (auto st = device_->Upload(stream_, {&dst, 1}, image.size(),
                                [&](uint64_t first, uint64_t n, char* const* staged) {
                                  std::memcpy(staged[0], image.data() + first, n);
                                });
      !st.ok()) {
    return st;
  }
  Launch launch;
  launch.tasks = reinterpret_cast<const Task*>(At(table_));
  launch.ranks = reinterpret_cast<const uint32_t*>(At(table_ + ranks_at));
  launch.task_count = static_cast<uint32_t>(batch.tasks.size());
  launch.unit_count = static_cast<uint32_t>(batch.units);
  launch.bf16_grads = layout_.grad_dtype == DType::kBf16;
  launch.bf16_state = false;
  launch.partials = reinterpret_cast<double*>(At(partials_));
  return launch;
}

absl::StatusOr<GradStats> CudaJobState::ReduceGrads(absl::Span<const ShardGrads> shards) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto st = device_->Enter(); !st.ok()) return st;
  std::vector<Work> work;
  for (const ShardGrads& sg : shards) {
    if (auto st = CheckShardGrads(layout_, sg); !st.ok()) return st;
    work.push_back({&sg, nullptr, 0, shards_[sg.shard].layout.numel});
  }
  // Partials come back in block order, shards in the order given, and are
  // summed here in that order from 0, as the CPU backend sums its own.
  GradStats stats;
  auto done = ForEachBatch(work, kReduceUnit, std::min(partials_capacity_, kMaxUnits), [&](const Batch& batch) {
    auto launch = UploadTable(batch);
    if (!launch.ok()) return launch.status();
    if (auto st = device_->Check(LaunchReduce(*launch, stream_), "the sum-of-squares launch"); !st.ok()) return st;
    // Waiting here, not inside Download, keeps the staging lock that other
    // jobs' transfers share free while the kernel runs.
    if (auto st = Sync(); !st.ok()) return st;
    return device_->Download(stream_, {At(partials_), sizeof(double)}, batch.units,
                             [&](uint64_t, uint64_t n, const char* staged) {
                               for (uint64_t i = 0; i < n; ++i) {
                                 stats.sum_squares += reinterpret_cast<const double*>(staged)[i];
                               }
                             });
  });
  if (!done.ok()) return done;
  stats.nonfinite = !std::isfinite(stats.sum_squares);
  return stats;
}

static_assert(kApplyAlignment % kChunk == 0, "a partial update must start on a chunk boundary");

absl::Status CudaJobState::EnqueueApply(absl::Span<const ShardStep> steps) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto st = device_->Enter(); !st.ok()) return st;
  std::vector<uint64_t> ends;
  for (const ShardStep& step : steps) {
    auto end = CheckShardStep(layout_, step);
    if (!end.ok()) return end.status();
    ends.push_back(*end);
  }
  // The state type is a template parameter of the kernel, so each precision
  // gets launches of its own.
  for (const Precision precision : {Precision::kFp32, Precision::kBf16}) {
    std::vector<Work> work;
    for (size_t i = 0; i < steps.size(); ++i) {
      if (shards_[steps[i].grads.shard].layout.precision == precision) {
        work.push_back({&steps[i].grads, &steps[i].scalars, steps[i].offset, ends[i]});
      }
    }
    auto st = ForEachBatch(work, kChunk, kMaxUnits, [&](const Batch& batch) {
      auto launch = UploadTable(batch);
      if (!launch.ok()) return launch.status();
      launch->bf16_state = precision == Precision::kBf16;
      return device_->Check(LaunchUpdate(*launch, stream_), "the fused AdamW launch");
    });
    if (!st.ok()) return st;
  }
  return absl::OkStatus();
}

absl::Status CudaJobState::Apply(absl::Span<const ShardStep> steps) {
  if (auto st = EnqueueApply(steps); !st.ok()) return st;
  // Kernel faults surface here, and the gradient slots are free to rewrite.
  return Sync();
}

absl::Status CudaJobState::FillParamsOut(uint32_t shard, uint8_t byte) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto st = device_->Enter(); !st.ok()) return st;
  if (auto st = CheckShardRange(layout_, shard, 0, 0); !st.ok()) return st;
  const Shard& s = shards_[shard];
  if (auto st = device_->Check(cudaMemsetAsync(At(s.param_out), byte, s.layout.numel * 2, stream_),
                               "cudaMemsetAsync");
      !st.ok()) {
    return st;
  }
  return Sync();
}

MemoryUse CudaJobState::memory_use() const {
  MemoryUse use;
  use.state_bytes = state_bytes_;
  // Everything else in the arena: gradient slots, bf16 params, the launch
  // table, the reduction partials and alignment padding.
  use.staging_bytes = arena_bytes_ - state_bytes_;
  return use;
}

Precision CudaJobState::held_precision(uint32_t shard) const {
  return shards_[shard].state_elem_bytes == 4 ? Precision::kFp32 : Precision::kBf16;
}

}  // namespace shardopt::cuda
