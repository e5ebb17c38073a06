// GET /metrics (and HEAD) over plain HTTP/1.1 on its own port, for
// Prometheus to scrape: one thread reads every connection at once (up to
// 64; past that the oldest is dropped), and answers and closes each once its
// request has come. Anything else is 404; a request that does not arrive
// within two seconds or 8 KiB is dropped.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "server/metrics.h"

namespace shardopt {

class MetricsServer {
 public:
  // Listens on host:port (port 0: an ephemeral one).
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& host, int port,
                                                              const metrics::Registry* registry);
  ~MetricsServer();
  int port() const { return port_; }
  // Scrapes (GET /metrics) answered so far: a server that must be seen
  // before it exits waits for the next one.
  uint64_t scrapes() const { return scrapes_.load(std::memory_order_relaxed); }

 private:
  MetricsServer(int fd, int port, const metrics::Registry* registry);
  void Serve();

  const int fd_;
  const int port_;
  const metrics::Registry* const registry_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> scrapes_{0};
  std::thread thread_;
};

}  // namespace shardopt
