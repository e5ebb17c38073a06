// Placement over S servers and the StatefulSet server pattern: pure
// functions, no network.
#include <map>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "shardopt/client.h"

namespace shardopt {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(Placement, EveryElementOnceAlignedAndSharesWithinOneBlock) {
  const std::vector<TensorOptions> tensors = {{"a", 3 * 4096 + 5, 0}, {"b", 1, 0}, {"c", 4096, 0}, {"d", 9000, 0}};
  for (uint32_t servers : {1u, 2u, 3u, 4u, 5u, 7u, 8u, 9u, 20u}) {
    const auto placed = PlaceTensors(tensors, servers);
    EXPECT_EQ(placed.size(), PlaceTensors(tensors, servers).size());
    std::map<std::string, uint64_t> next;  // tensor -> first element not yet placed
    std::vector<uint64_t> share(servers, 0);
    for (const ShardPlacement& p : placed) {
      ASSERT_LT(p.server, servers);
      EXPECT_EQ(p.offset, next[p.tensor]) << p.tensor << " on " << servers << " servers";
      EXPECT_EQ(p.offset % 4096, 0u);
      next[p.tensor] = p.offset + p.length;
      share[p.server] += p.length;
    }
    for (const TensorOptions& t : tensors) EXPECT_EQ(next[t.name], t.numel);
    // 9 blocks of 4096 in the flat space: shares differ by at most one
    // block (plus a tensor's padding), and no server is empty while blocks
    // are left to give it.
    const auto [lo, hi] = std::minmax_element(share.begin(), share.end());
    EXPECT_LE(*hi - *lo, 2 * 4096u) << servers << " servers";
    if (servers <= 9) {
      EXPECT_GT(*lo, 0u) << servers << " servers";
    }
  }
}

TEST(Placement, FiveBlocksOnFourServersLeaveNoneEmpty) {
  const auto bounds = ServerBounds({{"w", 5 * 4096, 0}}, 4);
  EXPECT_THAT(bounds, ElementsAre(0, 4096, 2 * 4096, 3 * 4096, 5 * 4096));
  EXPECT_TRUE(ServerBounds({{"w", 5 * 4096, 0}}, 0).empty());
}

// Past what a job may hold, the flat space wraps: the placement is then
// meaningless, but names only servers that exist (it read past its bounds
// and crashed, found by a black-box probe).
TEST(Placement, AWrappedFlatSpaceNamesOnlyServersThatExist) {
  for (const std::vector<TensorOptions>& tensors :
       {std::vector<TensorOptions>{{"h", ~uint64_t{0} - 4095}, {"h2", 100}},
        std::vector<TensorOptions>{{"a", uint64_t{1} << 63}, {"b", uint64_t{1} << 63}}}) {
    for (const ShardPlacement& p : PlaceTensors(tensors, 2)) EXPECT_LT(p.server, 2u) << p.tensor;
  }
}

TEST(ServerPattern, ExpandsAStatefulSetsNames) {
  EXPECT_THAT(ExpandServerPattern("shardopt-{i}.shardopt:50051", 3).value(),
              ElementsAre("shardopt-0.shardopt:50051", "shardopt-1.shardopt:50051", "shardopt-2.shardopt:50051"));
}

TEST(ServerPattern, RefusesWhatIsNotAPattern) {
  struct Case {
    const char* pattern;
    uint32_t count;
    const char* says;
  } cases[] = {
      {"shardopt-0.shardopt:50051", 2, "exactly once"},
      {"s-{i}-{i}:50051", 2, "exactly once"},
      {"shardopt-{i}.shardopt", 2, ":PORT"},
      {"shardopt-{i}.shardopt:0", 2, ":PORT"},
      {"shardopt-{i}.shardopt:70000", 2, ":PORT"},
      {"shardopt-{i}.shardopt:+50051", 2, ":PORT"},
      {"shardopt-{i}.shardopt: 50051", 2, ":PORT"},
      {"shardopt-{i}.shardopt:50051 ", 2, ":PORT"},
      {"shardopt-{i}.shardopt:000050051", 2, ":PORT"},
      {"shardopt-{i}.shardopt:50051", 0, "server count"},
  };
  for (const Case& c : cases) {
    auto r = ExpandServerPattern(c.pattern, c.count);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.pattern;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr(c.says)) << c.pattern;
  }
}

TEST(ClientOptions, PushServersOutsideTheListAreRefused) {
  ClientOptions o;
  o.servers = {"127.0.0.1:1", "127.0.0.1:2"};
  o.push_servers = {1, 2};
  auto client = Client::Connect(o);
  EXPECT_EQ(client.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(client.status().message()), HasSubstr("server 2 of 2"));
}

TEST(CombinePartials, SumsInServerOrder) {
  const PushResult r = CombinePartials({{1e16, false}, {1.0, false}, {-1e16, true}});
  EXPECT_EQ(r.sum_squares, (1e16 + 1.0) + -1e16);
  EXPECT_TRUE(r.nonfinite);
  EXPECT_EQ(r.partials.size(), 3u);
}

}  // namespace
}  // namespace shardopt
