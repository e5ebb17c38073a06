// How many bytes of gradient one Push message carries when the client is
// left to choose (ClientOptions::chunk_bytes = 0). The client sends them;
// the server expects them of a stream that has not yet shown its own size.
//
// Larger messages cost less per byte: one rank's push of 64M bf16 params on
// 2 cores took 0.033-0.042 s in 4 MiB messages, 0.044-0.049 s in 1 MiB and
// 0.058-0.063 s in 256 KiB (interleaved runs of shardopt-bench e2e). But a
// server's gRPC keeps about a message's worth of read buffer per connection
// (README, "Gradient staging": 1.4 MB a rank at 1 MiB, 0.5 MB at 256 KiB),
// so the size falls as the ranks grow: 4 MiB up to 2 ranks, then 8 MiB
// shared out over the ranks, and 256 KiB from 32 ranks on.
#pragma once

#include <algorithm>
#include <cstdint>

namespace shardopt {

inline constexpr uint64_t kMinAutoChunkBytes = uint64_t{256} << 10;
inline constexpr uint64_t kMaxAutoChunkBytes = uint64_t{4} << 20;
inline constexpr uint64_t kAutoChunkBytesPerJob = uint64_t{8} << 20;

inline uint64_t AutoChunkBytes(uint32_t world_size) {
  return std::clamp<uint64_t>(kAutoChunkBytesPerJob / std::max<uint32_t>(world_size, 1), kMinAutoChunkBytes,
                              kMaxAutoChunkBytes);
}

// What a client sends: `requested` if nonzero (the caller's choice, kept as
// given), else the automatic size, at most half the smallest message the
// job's servers take (the rest is room for the message's other fields). A
// server that does not say what it takes (`smallest_server_max` 0: one
// older than CreateJobResponse.max_message_bytes) gets the smallest
// automatic size, which every server has always taken.
inline uint64_t ChunkBytesFor(uint64_t requested, uint32_t world_size, uint64_t smallest_server_max) {
  if (requested > 0) return requested;
  if (smallest_server_max == 0) return kMinAutoChunkBytes;
  return std::max<uint64_t>(1, std::min(AutoChunkBytes(world_size), smallest_server_max / 2));
}

}  // namespace shardopt
