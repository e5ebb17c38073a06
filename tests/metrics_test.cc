// The Prometheus exposition keeps every bit of a value, in the fewest
// digits that give it back: a byte counter past a million, rendered with 6
// significant digits, would make rate() a staircase, and a bucket bound
// printed with 17 (le="0.10000000000000001") would rename its series.
#include "server/metrics.h"

#include <string>

#include "gtest/gtest.h"

namespace shardopt::metrics {
namespace {

TEST(MetricsTest, ValuesAreRenderedWithEveryDigit) {
  Registry registry;
  registry.Increment("shardopt_received_bytes_total", {{"method", "Push"}}, 12345678901.0);
  registry.Increment("shardopt_received_bytes_total", {{"method", "Push"}}, 7);
  registry.Observe("shardopt_checkpoint_seconds", {{"direction", "write"}}, 0.1);
  registry.Observe("shardopt_checkpoint_seconds", {{"direction", "write"}}, 0.2);
  const std::string page = registry.Render();
  EXPECT_NE(page.find("shardopt_received_bytes_total{method=\"Push\"} 12345678908\n"), std::string::npos) << page;
  // 0.1 + 0.2 needs 17 digits to come back; the bucket bound 0.1 needs one.
  EXPECT_NE(page.find("shardopt_checkpoint_seconds_sum{direction=\"write\"} 0.30000000000000004\n"), std::string::npos)
      << page;
  EXPECT_NE(page.find("le=\"0.1\"} 1\n"), std::string::npos) << page;
}

// A checkpoint of a whole server's state may take minutes (the manifests'
// grace periods budget up to about 250 s): its histogram's buckets go on
// past 60 s, where the per-step ones stop.
TEST(MetricsTest, CheckpointSecondsHaveBucketsPastAMinute) {
  Registry registry;
  registry.Observe("shardopt_checkpoint_seconds", {{"direction", "write"}}, 200);
  const std::string page = registry.Render();
  EXPECT_NE(page.find("shardopt_checkpoint_seconds_bucket{direction=\"write\",le=\"120\"} 0\n"), std::string::npos)
      << page;
  EXPECT_NE(page.find("shardopt_checkpoint_seconds_bucket{direction=\"write\",le=\"300\"} 1\n"), std::string::npos)
      << page;
}

}  // namespace
}  // namespace shardopt::metrics
