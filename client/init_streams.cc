#include "client/init_streams.h"

#include <algorithm>

namespace shardopt {

std::vector<std::vector<InitPiece>> CutIntoStreams(absl::Span<const InitRange> ranges, uint64_t limit_bytes) {
  std::vector<std::vector<InitPiece>> streams;
  uint64_t filled = limit_bytes;  // bytes in the last stream: none yet, so as if full
  for (size_t r = 0; r < ranges.size(); ++r) {
    const InitRange& range = ranges[r];
    for (uint64_t off = range.offset; off < range.offset + range.length;) {
      if (limit_bytes - std::min(filled, limit_bytes) < range.esize) {
        streams.emplace_back();
        filled = 0;
      }
      // A limit below one element still takes one.
      const uint64_t room = std::max<uint64_t>(1, (limit_bytes - filled) / range.esize);
      const uint64_t n = std::min(range.offset + range.length - off, room);
      streams.back().push_back({r, off, n});
      filled += n * range.esize;
      off += n;
    }
  }
  return streams;
}

}  // namespace shardopt
