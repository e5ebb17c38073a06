// The collectives a node group needs among the G local ranks of one node,
// behind one interface: CpuCollective (threads of one process, host memory),
// and in client/nccl/ an NCCL one (one GPU per rank, device memory), built
// only when CUDA is on. Every rank calls every operation in the same order.
//
// Thread safety: each rank's Collective is used by that rank's thread alone;
// the ranks call it at once, which is the point.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace shardopt {

// [begin, end) in elements of a flat buffer.
struct FlatRange {
  uint64_t begin = 0;
  uint64_t end = 0;
  uint64_t size() const { return end - begin; }
};

class Collective {
 public:
  virtual ~Collective() = default;
  virtual uint32_t rank() const = 0;
  virtual uint32_t size() const = 0;

  // Rank r receives, in `out` (host memory, ranges[r].size() floats), the fp32 sum over
  // the ranks of `in` (bf16) in ranges[r]. The ranges are disjoint, one per
  // rank, and may be empty. The sum runs in fp32 so that a node's partial
  // loses nothing that the servers' fp32 aggregation would keep.
  virtual absl::Status ReduceScatter(const uint16_t* in, float* out, absl::Span<const FlatRange> ranges) = 0;
  // Every rank ends with every rank r's `data` in ranges[r] (bf16).
  virtual absl::Status AllGather(uint16_t* data, absl::Span<const FlatRange> ranges) = 0;
  // Sums `count` host doubles over the ranks, in place.
  virtual absl::Status AllReduceSum(double* data, uint64_t count) = 0;
  // Copies from the host into the collective's memory (host or device).
  virtual absl::Status FromHost(const void* host_src, void* dst, uint64_t bytes) = 0;
};

// G ranks as threads of one process. ReduceScatter adds the ranks in rank
// order, so its fp32 sums are the ones a server computes for G ranks. A rank
// that does not reach an operation within `barrier_timeout` fails the
// others' with DEADLINE_EXCEEDED, and every later one. Keep it above the
// longest a push may retry, max_attempts x (barrier_timeout_ms +
// rpc_timeout_ms): 10 minutes with the client's defaults, hence 11.
std::vector<std::unique_ptr<Collective>> MakeCpuCollectives(
    uint32_t size, std::chrono::milliseconds barrier_timeout = std::chrono::minutes(11));

}  // namespace shardopt
