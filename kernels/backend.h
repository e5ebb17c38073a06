// The seam between the step protocol and the numerics. A Backend allocates a
// job's optimizer state; the JobState holds it (host or device memory) and
// runs the fused update over a batch of shards in one call. Nothing here knows
// about gRPC, jobs' names or steps.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "base/pieces.h"
#include "kernels/adamw_math.h"

namespace shardopt {

// How a group keeps its params, m and v. FP32 is the product; BF16 exists to
// save memory and to show what bf16 state does (docs/design.md, sections 1
// and 3.4).
enum class Precision : uint8_t { kFp32, kBf16 };
// The element type of data crossing the interface.
enum class DType : uint8_t { kFp32, kBf16 };
enum class StateKind : uint8_t { kMaster, kExpAvg, kExpAvgSq, kParamBf16 };

inline constexpr uint64_t DTypeSize(DType d) { return d == DType::kFp32 ? 4 : 2; }
const char* PrecisionName(Precision p);
const char* DTypeName(DType d);
const char* StateKindName(StateKind k);

struct ShardLayout {
  uint64_t numel = 0;
  Precision precision = Precision::kFp32;
};

struct JobLayout {
  std::vector<ShardLayout> shards;
  // Each rank's gradient is kept apart until the step is applied, so that the
  // fp32 sum runs in rank order whatever order the chunks arrived in.
  uint32_t world_size = 1;
  DType grad_dtype = DType::kBf16;
};

// Master, m and v of every shard of `layout`, on any backend: 12 bytes a
// param in fp32, 6 in bf16.
inline uint64_t StateBytes(const JobLayout& layout) {
  uint64_t bytes = 0;
  for (const ShardLayout& s : layout.shards) bytes += s.numel * (s.precision == Precision::kFp32 ? 12 : 6);
  return bytes;
}

struct GradStats {
  double sum_squares = 0;  // of the aggregated, unscaled gradient
  bool nonfinite = false;
};

// The ranks that contributed a gradient to one shard in this step, ascending.
// A rank absent from the list had no gradient for that tensor.
struct ShardGrads {
  uint32_t shard = 0;
  std::vector<uint32_t> ranks;
};

// Where a partial update may start: a multiple of every backend's unit of
// work (the CUDA kernel's chunk, the CPU's tile), so that vector accesses stay
// aligned and the elements a unit covers never depend on the split.
inline constexpr uint64_t kApplyAlignment = 16384;

struct ShardStep {
  ShardGrads grads;
  math::AdamWScalars scalars;
  // The part of the shard to update, [offset, offset + length); length 0 means
  // to the shard's end. Updating a shard in parts gives the same bits as in
  // one call, which lets the server stream params while it computes.
  uint64_t offset = 0;
  uint64_t length = 0;
};

struct MemoryUse {
  uint64_t state_bytes = 0;    // master, m and v
  uint64_t staging_bytes = 0;  // per-rank gradient slots and the bf16 params out
  uint64_t bookkeeping_bytes = 0;  // what is kept about them (a running sum's per-tile flags and sums of squares)
};

// The argument checks every JobState makes, so that backends refuse alike.
absl::Status CheckShardRange(const JobLayout& layout, uint32_t shard, uint64_t offset, uint64_t count);
absl::Status CheckGradWrite(const JobLayout& layout, uint32_t shard, uint32_t rank, uint64_t offset, DType dtype,
                            uint64_t count);
// Checks that the layout keeps one fp32 slot and the range lies in the shard.
absl::Status CheckAccumulate(const JobLayout& layout, uint32_t shard, uint64_t offset, uint64_t count);
absl::Status CheckShardGrads(const JobLayout& layout, const ShardGrads& grads);
// Element i of `data` (fp32 or bf16, at any address) as a float, widened
// exactly.
inline float LoadAsFloat(const char* data, uint64_t i, DType dtype) {
  if (dtype == DType::kFp32) {
    float x;
    __builtin_memcpy(&x, data + 4 * i, 4);
    return x;
  }
  uint16_t h;
  __builtin_memcpy(&h, data + 2 * i, 2);
  return math::bf16_to_float(h);
}
// bf16 to float, exactly: how a bf16 gradient enters fp32 gradient slots.
void WidenBf16(const uint16_t* in, uint64_t count, float* out);
// acc[i] = src[i] widened when `first`, else math::add(acc[i], src[i]): the
// CPU loops' accumulate, one element at a time, for a backend that folds on
// the host. `src` need not be aligned.
void AccumulateOnHost(float* acc, const void* src, DType dtype, uint64_t count, bool first);
// The elements in an AccumulateGrad's runs.
uint64_t RunElements(absl::Span<const absl::string_view> runs, DType dtype);

// Checks grads and range, and returns the end of the range to update.
absl::StatusOr<uint64_t> CheckShardStep(const JobLayout& layout, const ShardStep& step);

class JobState {
 public:
  virtual ~JobState() = default;

  // Stores `count` gradient elements of `rank` at `offset` in `shard`. The
  // dtype is the layout's grad_dtype, or bf16 into fp32 slots, widened
  // exactly: a job whose tensors push both keeps fp32 slots, and the sum's
  // bits are those of summing the bf16 values as floats.
  virtual absl::Status WriteGrad(uint32_t shard, uint32_t rank, uint64_t offset, DType dtype,
                                 const void* data, uint64_t count) = 0;
  // Folds elements of one rank's gradient, from `offset` on, into the
  // running fp32 sum kept in slot 0 of a layout of one fp32 slot
  // (AccumulatingLayout): with `first` the sum becomes them, widened exactly;
  // otherwise each element becomes sum + it, one fp32 add. Folding the ranks
  // in rank order gives the bits of keeping them apart and adding their
  // slots in rank order, with 4 B/param of staging whatever the number of
  // ranks. The elements come as `runs`, in order, each a whole number of
  // `dtype` elements at any address (a received message's pieces).
  virtual absl::Status AccumulateGrad(uint32_t shard, uint64_t offset, DType dtype,
                                      absl::Span<const absl::string_view> runs, bool first) = 0;
  // The running sum's elements [offset, offset + count) of `shard` are final
  // for this step: every rank has folded them or has no gradient for them.
  // `offset` is a multiple of kApplyAlignment. A backend may take their sum
  // of squares now, while they are fresh in its caches, for ReduceGrads to
  // use instead of reading the whole sum again at the barrier; the result is
  // the same fixed tree's.
  virtual void GradBlockDone(uint32_t /*shard*/, uint64_t /*offset*/, uint64_t /*count*/) {}
  // Sets master, m or v. fp32 data into an FP32 shard is kept exactly; into a
  // BF16 shard it is rounded, which is that precision's meaning. Writing the
  // master also refreshes the bf16 params. `data` need not be aligned (a
  // restore's pieces start wherever the part's frame ends); it may be the
  // state's own memory (HostFp32State), already read into place, and then
  // only the params are refreshed.
  virtual absl::Status WriteState(uint32_t shard, StateKind kind, uint64_t offset, DType dtype,
                                  const void* data, uint64_t count) = 0;
  // Makes the host memory of elements [offset, offset + count) of `shard`'s
  // master, m, v or bf16 params (which a write of the master writes too)
  // resident ahead of WriteState, so that a bulk write (a
  // restore's) does not stop for page faults: a restore calls it on a
  // thread of its own, ahead of the data. It changes no value and may run
  // while the same range is being written. A hint: a backend may do nothing.
  virtual void Prefault(uint32_t /*shard*/, StateKind /*kind*/, uint64_t /*offset*/, uint64_t /*count*/) const {}
  // Where the host holds master, m or v of `shard` as fp32, numel elements,
  // for a snapshot to write it from rather than through a buffer and a
  // copy; null where it is held otherwise (on a device, or in bf16).
  virtual char* HostFp32State(uint32_t /*shard*/, StateKind /*kind*/) { return nullptr; }
  // How many bytes from HostFp32State(shard, kind) on may be written: the
  // array's, or more where its memory is whole pages (a restore reads a
  // checkpoint's page-padded array straight into it only if the padding
  // fits). 0 where HostFp32State is null.
  virtual uint64_t HostStateRoom(uint32_t /*shard*/, StateKind /*kind*/) const { return 0; }
  // Reads any state as fp32 (exact for both precisions) or the params as bf16.
  virtual absl::Status ReadState(uint32_t shard, StateKind kind, uint64_t offset, uint64_t count,
                                 DType dtype, void* out) const = 0;
  // ReadState's bytes held where they lie rather than copied, where the
  // backend can (the CPU's bf16 params), so that a commit sends them as
  // they are; they stay unchanged while the result lives, whatever the job
  // does meanwhile. Otherwise they are read into a buffer the result owns.
  virtual absl::StatusOr<Pieces> HoldState(uint32_t shard, StateKind kind, uint64_t offset, uint64_t count,
                                              DType dtype) const;
  // Sum of squares and the nonfinite flag of the aggregated gradient, by the
  // fixed tree of adamw_math.h, over the shards in the order given.
  virtual absl::StatusOr<GradStats> ReduceGrads(absl::Span<const ShardGrads> shards) const = 0;
  // Applies one AdamW step to every listed shard, in one batched call.
  virtual absl::Status Apply(absl::Span<const ShardStep> steps) = 0;
  virtual MemoryUse memory_use() const = 0;
  // The precision the shard's state is actually held in, for VerifyState.
  virtual Precision held_precision(uint32_t shard) const = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  // "cpu" or "cuda:N", with what it runs on.
  virtual std::string Describe() const = 0;
  // Fails with RESOURCE_EXHAUSTED, holding nothing, when the job does not fit.
  virtual absl::StatusOr<std::unique_ptr<JobState>> Allocate(const JobLayout& layout) = 0;
  // The host memory a job of `layout` holds: what the server's memory
  // budget charges for it (server/memory_budget.h). Device memory is the
  // device's to refuse.
  virtual uint64_t HostBytes(const JobLayout& layout) const = 0;
};

}  // namespace shardopt
