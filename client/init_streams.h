// Where an Init's values are cut into streams. A call's deadline
// (rpc_timeout_ms) is its whole stream's, so a server's share of a large
// model goes in several streams of bounded size, one after another; and
// many small tensors share one, since a stream each costs a round trip.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace shardopt {

// Elements [offset, offset + length) of one array, `esize` bytes each.
struct InitRange {
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t esize = 4;
};

// A piece of ranges[range]: elements [offset, offset + length).
struct InitPiece {
  size_t range = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
};

// The ranges in order, cut into streams of at most `limit_bytes` each
// (at least one element's worth), each stream filled before the next
// begins; a range is split where a stream fills. Empty ranges are left out.
// Each range's esize is at least 1, and its offset + length below 2^64 (a
// tensor's elements, at most 2^40).
std::vector<std::vector<InitPiece>> CutIntoStreams(absl::Span<const InitRange> ranges, uint64_t limit_bytes);

}  // namespace shardopt
