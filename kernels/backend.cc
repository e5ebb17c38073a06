#include "kernels/backend.h"

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace shardopt {

const char* PrecisionName(Precision p) { return p == Precision::kFp32 ? "FP32" : "BF16"; }
const char* DTypeName(DType d) { return d == DType::kFp32 ? "fp32" : "bf16"; }
const char* StateKindName(StateKind k) {
  switch (k) {
    case StateKind::kMaster: return "master";
    case StateKind::kExpAvg: return "exp_avg";
    case StateKind::kExpAvgSq: return "exp_avg_sq";
    case StateKind::kParamBf16: return "param_bf16";
  }
  return "?";
}

absl::Status CheckShardRange(const JobLayout& layout, uint32_t shard, uint64_t offset, uint64_t count) {
  if (shard >= layout.shards.size()) return absl::InvalidArgumentError("shard index out of range");
  const uint64_t numel = layout.shards[shard].numel;
  if (offset > numel || count > numel - offset) {
    return absl::OutOfRangeError(
        absl::StrCat("range [", offset, ", ", offset + count, ") is past the shard's ", numel, " elements"));
  }
  return absl::OkStatus();
}

absl::Status CheckGradWrite(const JobLayout& layout, uint32_t shard, uint32_t rank, uint64_t offset, DType dtype,
                            uint64_t count) {
  SHARDOPT_RETURN_IF_ERROR(CheckShardRange(layout, shard, offset, count));
  if (rank >= layout.world_size) return absl::InvalidArgumentError("rank out of range");
  if (dtype != layout.grad_dtype && !(dtype == DType::kBf16 && layout.grad_dtype == DType::kFp32)) {
    return absl::InvalidArgumentError("fp32 gradients into a job that keeps bf16 gradient slots");
  }
  return absl::OkStatus();
}

absl::Status CheckAccumulate(const JobLayout& layout, uint32_t shard, uint64_t offset, uint64_t count) {
  SHARDOPT_RETURN_IF_ERROR(CheckShardRange(layout, shard, offset, count));
  if (layout.world_size != 1 || layout.grad_dtype != DType::kFp32) {
    return absl::FailedPreconditionError("a running sum needs a layout of one fp32 gradient slot");
  }
  return absl::OkStatus();
}

absl::Status CheckShardGrads(const JobLayout& layout, const ShardGrads& grads) {
  if (grads.shard >= layout.shards.size()) return absl::InvalidArgumentError("shard index out of range");
  if (grads.ranks.empty()) return absl::InvalidArgumentError("a shard in the batch has no contributing rank");
  for (size_t i = 0; i < grads.ranks.size(); ++i) {
    if (grads.ranks[i] >= layout.world_size || (i > 0 && grads.ranks[i] <= grads.ranks[i - 1])) {
      return absl::InvalidArgumentError("contributing ranks must be ascending and below world_size");
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> CheckShardStep(const JobLayout& layout, const ShardStep& step) {
  SHARDOPT_RETURN_IF_ERROR(CheckShardGrads(layout, step.grads));
  const uint64_t numel = layout.shards[step.grads.shard].numel;
  if (step.offset % kApplyAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat("update offset ", step.offset, " is not a multiple of ", kApplyAlignment));
  }
  const uint64_t length = step.length == 0 && step.offset < numel ? numel - step.offset : step.length;
  SHARDOPT_RETURN_IF_ERROR(CheckShardRange(layout, step.grads.shard, step.offset, length));
  return step.offset + length;
}

void WidenBf16(const uint16_t* in, uint64_t count, float* out) {
  for (uint64_t i = 0; i < count; ++i) out[i] = math::bf16_to_float(in[i]);
}

void AccumulateOnHost(float* acc, const void* src, DType dtype, uint64_t count, bool first) {
  for (uint64_t i = 0; i < count; ++i) {
    const float x = LoadAsFloat(static_cast<const char*>(src), i, dtype);
    acc[i] = first ? x : math::add(acc[i], x);
  }
}

absl::StatusOr<Pieces> JobState::HoldState(uint32_t shard, StateKind kind, uint64_t offset, uint64_t count,
                                              DType dtype) const {
  // Uninitialized: ReadState writes every byte.
  std::shared_ptr<char> buffer(new char[std::max<uint64_t>(count * DTypeSize(dtype), 1)],
                               std::default_delete<char[]>());
  SHARDOPT_RETURN_IF_ERROR(ReadState(shard, kind, offset, count, dtype, buffer.get()));
  const absl::string_view bytes(buffer.get(), count * DTypeSize(dtype));  // before `buffer` is moved
  return Pieces({bytes}, std::move(buffer));
}

uint64_t RunElements(absl::Span<const absl::string_view> runs, DType dtype) {
  uint64_t bytes = 0;
  for (absl::string_view r : runs) bytes += r.size();
  return bytes / DTypeSize(dtype);
}

}  // namespace shardopt
