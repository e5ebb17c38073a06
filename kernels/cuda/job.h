// A job's state in device memory: one cudaMalloc arena holding every shard's
// master, m, v, bf16 params and per-rank gradient slots, plus the launch table
// and the reduction partials. Semantics and status codes are CpuJobState's.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <mutex>
#include <vector>

#include "absl/functional/function_ref.h"
#include "kernels/backend.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/kernel_args.h"

namespace shardopt::cuda {

class CudaJobState final : public JobState {
 public:
  // Fails with RESOURCE_EXHAUSTED, holding nothing, when the job does not fit
  // the device's free memory.
  static absl::StatusOr<std::unique_ptr<CudaJobState>> Create(std::shared_ptr<Device> device,
                                                              const JobLayout& layout);
  ~CudaJobState() override;

  absl::Status WriteGrad(uint32_t shard, uint32_t rank, uint64_t offset, DType dtype, const void* data,
                         uint64_t count) override;
  absl::Status WriteState(uint32_t shard, StateKind kind, uint64_t offset, DType dtype, const void* data,
                          uint64_t count) override;
  absl::Status ReadState(uint32_t shard, StateKind kind, uint64_t offset, uint64_t count, DType dtype,
                         void* out) const override;
  absl::StatusOr<GradStats> ReduceGrads(absl::Span<const ShardGrads> shards) const override;
  absl::Status Apply(absl::Span<const ShardStep> steps) override;
  MemoryUse memory_use() const override;
  Precision held_precision(uint32_t shard) const override;

  // Apply without waiting for the kernels, so the benchmark can queue them
  // back to back on stream().
  absl::Status EnqueueApply(absl::Span<const ShardStep> steps);
  // Sets every byte of a shard's device bf16 params, so that a test sees any
  // element a launch failed to write.
  absl::Status FillParamsOut(uint32_t shard, uint8_t byte);
  DeviceArray arena() const { return {arena_, 1}; }
  uint64_t arena_bytes() const { return arena_bytes_; }
  cudaStream_t stream() const { return stream_; }

 private:
  struct Shard {
    ShardLayout layout;
    uint64_t state_elem_bytes = 0;  // 4 for FP32, 2 for BF16
    // Byte offsets into the arena, each 256-byte aligned.
    uint64_t p = 0, m = 0, v = 0, param_out = 0, grads = 0;
    uint64_t slot_stride = 0;  // one rank's gradient slot, rounded up to keep every slot aligned
  };
  // One shard's entry in a launch; the reduction has no scalars.
  struct Work {
    const ShardGrads* grads;
    const math::AdamWScalars* scalars;
    uint64_t begin;  // the shard's elements [begin, end)
    uint64_t end;
  };
  struct Batch {
    std::vector<Task> tasks;
    std::vector<uint32_t> ranks;
    uint64_t units = 0;
  };

  CudaJobState(std::shared_ptr<Device> device, JobLayout layout)
      : device_(std::move(device)), layout_(std::move(layout)) {}
  absl::Status Init();

  char* At(uint64_t offset) const { return static_cast<char*>(arena_) + offset; }
  uint64_t StateOffset(const Shard& s, StateKind kind) const;
  absl::Status Sync() const;

  // Cuts `work` into launches of at most `max_units` units of `unit` elements
  // whose table fits the arena's, splitting a shard at a unit boundary where
  // it must, and runs `launch` on each in order.
  absl::Status ForEachBatch(absl::Span<const Work> work, uint64_t unit, uint64_t max_units,
                            absl::FunctionRef<absl::Status(const Batch&)> launch) const;
  // Copies the batch's table to the device and returns the launch over it.
  absl::StatusOr<Launch> UploadTable(const Batch& batch) const;

  std::shared_ptr<Device> device_;
  JobLayout layout_;
  std::vector<Shard> shards_;
  uint64_t state_bytes_ = 0;
  uint64_t table_ = 0, table_capacity_ = 0;
  uint64_t partials_ = 0, partials_capacity_ = 0;
  void* arena_ = nullptr;
  uint64_t arena_bytes_ = 0;
  cudaStream_t stream_ = nullptr;
  // The protocol orders a job's calls; the lock makes concurrent callers
  // safe, and the single stream orders their device work.
  mutable std::mutex mu_;
};

}  // namespace shardopt::cuda
