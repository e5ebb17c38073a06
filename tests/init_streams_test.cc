// CutIntoStreams (client/init_streams.h): the pieces tile every range in
// order, each stream holds at most the limit (or one element, where the
// limit is smaller), and each stream is full before the next begins.
#include "client/init_streams.h"

#include <random>

#include "gtest/gtest.h"

namespace shardopt {
namespace {

TEST(InitStreamsTest, PiecesTileEveryRangeInOrderWithinTheLimitAndFillEachStream) {
  std::mt19937_64 rng(20261206);
  for (int round = 0; round < 500; ++round) {
    std::vector<InitRange> ranges(rng() % 8);
    for (InitRange& r : ranges) r = {rng() % 1000, rng() % 4 == 0 ? 0 : rng() % 300, rng() % 2 ? 4u : 2u};
    const uint64_t limit = std::vector<uint64_t>{1, 3, 4, 7, 64, 1000, 1 << 20}[rng() % 7];
    const auto streams = CutIntoStreams(ranges, limit);

    std::vector<uint64_t> next(ranges.size());  // each range's next element to be covered
    for (size_t r = 0; r < ranges.size(); ++r) next[r] = ranges[r].offset;
    size_t last_range = 0;
    for (size_t s = 0; s < streams.size(); ++s) {
      ASSERT_FALSE(streams[s].empty()) << "round " << round;
      uint64_t bytes = 0;
      for (const InitPiece& p : streams[s]) {
        ASSERT_LT(p.range, ranges.size());
        ASSERT_GE(p.range, last_range) << "ranges out of order";
        last_range = p.range;
        ASSERT_GT(p.length, 0u);
        ASSERT_EQ(p.offset, next[p.range]) << "a gap or an overlap in range " << p.range;
        next[p.range] += p.length;
        bytes += p.length * ranges[p.range].esize;
      }
      const InitPiece& only = streams[s].front();
      if (!(streams[s].size() == 1 && only.length == 1)) ASSERT_LE(bytes, limit) << "round " << round;
      if (s + 1 < streams.size()) {
        const InitPiece& after = streams[s + 1].front();
        ASSERT_GT(bytes + ranges[after.range].esize, limit) << "stream " << s << " began another before it was full";
      }
    }
    for (size_t r = 0; r < ranges.size(); ++r) {
      EXPECT_EQ(next[r], ranges[r].offset + ranges[r].length) << "range " << r << " not covered";
    }
  }
}

}  // namespace
}  // namespace shardopt
