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
#include <vector>

namespace shardopt {

// The largest message a server takes and sends unless told otherwise
// (--max_message_bytes): twice the largest automatic chunk, so that a 4 MiB
// chunk has room for the message's other fields.
inline constexpr int kDefaultMaxMessageBytes = 8 << 20;

// What a server charges its memory budget for each chunk packed in a push
// message (GradChunk.more), beside the message's bytes: what reading one
// costs it (about 210 B measured). A client packs at most chunk_bytes /
// this many chunks into a message, so that a message is charged at most
// twice its chunk size, as the window's accounting, in bytes, expects.
inline constexpr uint64_t kPackedChunkCharge = 256;

inline constexpr uint64_t kMinAutoChunkBytes = uint64_t{256} << 10;
inline constexpr uint64_t kMaxAutoChunkBytes = uint64_t{4} << 20;
inline constexpr uint64_t kAutoChunkBytesPerJob = uint64_t{8} << 20;

inline uint64_t AutoChunkBytes(uint32_t world_size) {
  return std::clamp<uint64_t>(kAutoChunkBytesPerJob / std::max<uint32_t>(world_size, 1), kMinAutoChunkBytes,
                              kMaxAutoChunkBytes);
}

// What a client sends: `requested` if nonzero (the caller's choice, kept as
// given), else the automatic size, at most half the smallest message that
// the servers it sends to take (`server_max`, from CreateJobResponse; the
// rest is room for the message's other fields). A server that does not say
// (0: one older than CreateJobResponse.max_message_bytes) holds it to 256
// KiB, the old default.
inline uint64_t ChunkBytesFor(uint64_t requested, uint32_t world_size, const std::vector<uint64_t>& server_max) {
  if (requested > 0) return requested;
  uint64_t bytes = AutoChunkBytes(world_size);
  for (uint64_t max : server_max) bytes = std::min(bytes, max == 0 ? kMinAutoChunkBytes : max / 2);
  return std::max<uint64_t>(1, bytes);
}

}  // namespace shardopt
