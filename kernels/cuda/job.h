// A job's state in device memory: one cudaMalloc arena holding every shard's
// master, m, v, bf16 params and per-rank gradient slots, plus the launch table
// and the reduction partials. Semantics and status codes are CpuJobState's.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <mutex>

#include "kernels/backend.h"
#include "kernels/cuda/device.h"
#include "kernels/cuda/launch_plan.h"

namespace shardopt::cuda {

class CudaJobState final : public JobState {
 public:
  // Fails with RESOURCE_EXHAUSTED, holding nothing, when the job does not fit
  // the device's free memory.
  static absl::StatusOr<std::unique_ptr<CudaJobState>> Create(std::shared_ptr<Device> device,
                                                              const JobLayout& layout);
  ~CudaJobState() override;

  absl::Status AccumulateGrad(uint32_t shard, uint64_t offset, DType dtype, absl::Span<const absl::string_view> runs,
                              bool first) override;
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
  uint64_t arena_bytes() const { return plan_.bytes(); }
  cudaStream_t stream() const { return stream_; }

 private:
  CudaJobState(std::shared_ptr<Device> device, ArenaPlan plan) : device_(std::move(device)), plan_(std::move(plan)) {}
  absl::Status Init();

  char* At(uint64_t offset) const { return static_cast<char*>(arena_) + offset; }
  absl::Status Sync() const;
  // Copies a launch's table to the arena's table slot.
  absl::Status UploadTable(const TableImage& table) const;

  std::shared_ptr<Device> device_;
  const ArenaPlan plan_;
  void* arena_ = nullptr;
  cudaStream_t stream_ = nullptr;
  // The protocol orders a job's calls; the lock makes concurrent callers
  // safe, and the single stream orders their device work.
  mutable std::mutex mu_;
};

}  // namespace shardopt::cuda
