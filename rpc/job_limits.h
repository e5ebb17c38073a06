// The protocol's limits on a job, which the servers enforce and the client
// checks before its own arithmetic on them (placement, offsets).
#pragma once

#include <cstddef>
#include <cstdint>

namespace shardopt {

inline constexpr uint32_t kMaxWorldSize = 65536;
// 2^40 elements (a 1T-parameter tensor): with world_size at most 2^16, every
// byte count a backend computes stays far below 2^64.
inline constexpr uint64_t kMaxNumel = uint64_t{1} << 40;
// Names become file and directory names (checkpoint/format.h) and appear in
// error messages.
inline constexpr size_t kMaxNameBytes = 200;
// TensorSpec.shape: a model's params have a few dimensions, and each one
// is kept per tensor and sent with every CreateJob.
inline constexpr size_t kMaxShapeDims = 32;

}  // namespace shardopt
