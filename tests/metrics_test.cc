// The Prometheus exposition keeps every bit of a value: a byte counter
// past a million, rendered with 6 significant digits, would make rate() a
// staircase and an increase() of a few bytes invisible.
#include "server/metrics.h"

#include <string>

#include "gtest/gtest.h"

namespace shardopt::metrics {
namespace {

TEST(MetricsTest, ValuesAreRenderedWithEveryDigit) {
  Registry registry;
  registry.Increment("shardopt_received_bytes_total", {{"method", "Push"}}, 12345678901.0);
  registry.Increment("shardopt_received_bytes_total", {{"method", "Push"}}, 7);
  registry.Observe("shardopt_checkpoint_seconds", {{"direction", "write"}}, 0.125);
  const std::string page = registry.Render();
  EXPECT_NE(page.find("shardopt_received_bytes_total{method=\"Push\"} 12345678908\n"), std::string::npos) << page;
  EXPECT_NE(page.find("shardopt_checkpoint_seconds_sum{direction=\"write\"} 0.125\n"), std::string::npos) << page;
}

}  // namespace
}  // namespace shardopt::metrics
