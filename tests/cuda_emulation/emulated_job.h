// A CUDA job's arena in host memory, laid out by the device's ArenaPlan, whose
// launches are the device's (the same plan, tables and Launch structs) with
// the kernels run by the host emulation. Tests fill it with the bytes a CPU
// job holds, run both, and compare every byte.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/backend.h"
#include "kernels/cuda/launch_plan.h"

namespace shardopt::testing {

class EmulatedCudaJob {
 public:
  // `slot_bytes` is the device's staging slot (cuda::Device::kSlotBytes);
  // smaller values make the plan split work into more launches.
  static absl::StatusOr<std::unique_ptr<EmulatedCudaJob>> Create(const JobLayout& layout, uint64_t slot_bytes);

  // A state buffer of a shard, in its stored type: fp32 or bf16 bits per the
  // shard's precision for master, m and v; bf16 for the params.
  void Put(uint32_t shard, StateKind kind, absl::Span<const uint8_t> stored);
  std::vector<uint8_t> Get(uint32_t shard, StateKind kind) const;
  // One rank's whole gradient slot, in the layout's gradient dtype.
  void PutGrad(uint32_t shard, uint32_t rank, absl::Span<const uint8_t> grad);
  // Fills the bf16 params of a shard's elements [begin, end) with 0xFFFF, a
  // NaN no update of finite values writes.
  void PoisonParams(uint32_t shard, uint64_t begin, uint64_t end);

  // The device's Apply and ReduceGrads. Each also fails when a launch wrote
  // any byte of the arena (or of a guard zone past its end) that it should
  // not have: anything but the stepped elements' state, the table and the
  // reduction's partials.
  absl::Status Apply(absl::Span<const ShardStep> steps);
  absl::StatusOr<GradStats> ReduceGrads(absl::Span<const ShardGrads> shards);

  // Launches run so far, so a test can tell that it split work.
  int launches() const { return launches_; }

 private:
  struct Range {
    uint64_t begin, end;  // bytes of the arena
  };

  explicit EmulatedCudaJob(cuda::ArenaPlan plan);
  char* arena() { return arena_.get(); }
  uint8_t* Bytes(uint32_t shard, StateKind kind) const;
  uint64_t StoredBytes(uint32_t shard, StateKind kind) const;
  // Copies a launch's table where the plan puts it, if it fits there.
  absl::Status Upload(const cuda::TableImage& table);
  // Runs `run` and fails if it changed a byte outside `writable`, the
  // table and the partials.
  absl::Status CheckedRun(std::vector<Range> writable, absl::FunctionRef<absl::Status()> run);
  // Which buffer an arena byte belongs to, for failure messages.
  std::string Describe(uint64_t offset) const;

  const cuda::ArenaPlan plan_;
  uint64_t size_;  // the arena and its guard zone
  std::unique_ptr<char, void (*)(void*)> arena_;
  int launches_ = 0;
};

}  // namespace shardopt::testing
