// The Collective of a node group on GPUs: NCCL among the node's G GPUs, one
// rank per GPU, buffers in device memory. Built only when CUDA is on, as its
// own target (shardopt_nccl), so that shardopt::client never links CUDA.
// This header names no CUDA or NCCL type.
//
// Numerics: ReduceScatter widens bf16 to fp32 on the device and reduces in
// fp32 with ncclReduce, whose order of addition is NCCL's (ring or tree, by
// its tuning), not rank order. So with G > 1 it matches the CPU collective to
// fp32 rounding, not bitwise, and is deterministic only as far as NCCL's
// choice of algorithm is for a fixed topology.
#pragma once

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "shardopt/collective.h"

namespace shardopt {

// ncclUniqueId's bytes: rank 0 makes one and sends it to the others.
struct NcclId {
  char bytes[128];
};
absl::StatusOr<NcclId> NewNcclId();

// Joins the group as `rank` of `size`, on CUDA device `device`. Blocks until
// every rank has joined.
absl::StatusOr<std::unique_ptr<Collective>> MakeNcclCollective(const NcclId& id, uint32_t rank, uint32_t size,
                                                               int device);

// Device memory for callers that have none of their own (tests, examples).
class DeviceBuffer {
 public:
  static absl::StatusOr<DeviceBuffer> Allocate(uint64_t bytes, int device);
  DeviceBuffer(DeviceBuffer&&) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&&) noexcept;
  ~DeviceBuffer();
  void* data() const { return data_; }
  absl::Status CopyToHost(void* host, uint64_t bytes) const;
  absl::Status CopyFromHost(const void* host, uint64_t bytes);

 private:
  DeviceBuffer() = default;
  void* data_ = nullptr;
};

// The number of usable CUDA devices; an error when there is no driver or no
// device, which callers treat as "no GPU".
absl::StatusOr<int> CudaDeviceCount();

}  // namespace shardopt
