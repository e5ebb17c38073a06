// The CPU backend with one behaviour changed, for tests: a JobState that
// forwards every call to the CPU's, for a test to derive from and override
// the call it changes (a failure to inject, a capability to hide), and a
// Backend whose jobs are the CPU's wrapped so.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "kernels/backend.h"
#include "kernels/cpu/cpu_backend.h"

namespace shardopt::testing {

class ForwardingJobState : public JobState {
 public:
  explicit ForwardingJobState(std::unique_ptr<JobState> cpu) : cpu_(std::move(cpu)) {}

  absl::Status WriteGrad(uint32_t shard, uint32_t rank, uint64_t offset, DType dtype, const void* data,
                         uint64_t count) override {
    return cpu_->WriteGrad(shard, rank, offset, dtype, data, count);
  }
  absl::Status AccumulateGrad(uint32_t shard, uint64_t offset, DType dtype, absl::Span<const absl::string_view> runs,
                              bool first) override {
    return cpu_->AccumulateGrad(shard, offset, dtype, runs, first);
  }
  void GradBlockDone(uint32_t shard, uint64_t offset, uint64_t count) override {
    cpu_->GradBlockDone(shard, offset, count);
  }
  absl::Status WriteState(uint32_t shard, StateKind kind, uint64_t offset, DType dtype, const void* data,
                          uint64_t count) override {
    return cpu_->WriteState(shard, kind, offset, dtype, data, count);
  }
  void Prefault(uint32_t shard, StateKind kind, uint64_t offset, uint64_t count) const override {
    cpu_->Prefault(shard, kind, offset, count);
  }
  char* HostFp32State(uint32_t shard, StateKind kind) override { return cpu_->HostFp32State(shard, kind); }
  uint64_t HostStateRoom(uint32_t shard, StateKind kind) const override { return cpu_->HostStateRoom(shard, kind); }
  absl::Status ReadState(uint32_t shard, StateKind kind, uint64_t offset, uint64_t count, DType dtype,
                         void* out) const override {
    return cpu_->ReadState(shard, kind, offset, count, dtype, out);
  }
  absl::StatusOr<Pieces> HoldState(uint32_t shard, StateKind kind, uint64_t offset, uint64_t count,
                                   DType dtype) const override {
    return cpu_->HoldState(shard, kind, offset, count, dtype);
  }
  absl::StatusOr<GradStats> ReduceGrads(absl::Span<const ShardGrads> shards) const override {
    return cpu_->ReduceGrads(shards);
  }
  absl::Status Apply(absl::Span<const ShardStep> steps) override { return cpu_->Apply(steps); }
  MemoryUse memory_use() const override { return cpu_->memory_use(); }
  Precision held_precision(uint32_t shard) const override { return cpu_->held_precision(shard); }

 private:
  const std::unique_ptr<JobState> cpu_;
};

class WrappedCpuBackend final : public Backend {
 public:
  using Wrap = std::function<std::unique_ptr<JobState>(std::unique_ptr<JobState> cpu)>;
  WrappedCpuBackend(std::string describe, Wrap wrap) : describe_(std::move(describe)), wrap_(std::move(wrap)) {}

  std::string Describe() const override { return describe_; }
  absl::StatusOr<std::unique_ptr<JobState>> Allocate(const JobLayout& layout) override {
    auto cpu = cpu_->Allocate(layout);
    if (!cpu.ok()) return cpu.status();
    return wrap_(*std::move(cpu));
  }
  uint64_t HostBytes(const JobLayout& layout) const override { return cpu_->HostBytes(layout); }

 private:
  const std::unique_ptr<Backend> cpu_ = MakeCpuBackend({});
  const std::string describe_;
  const Wrap wrap_;
};

}  // namespace shardopt::testing
