// GET /metrics (and HEAD) over plain HTTP/1.1 on its own port, for
// Prometheus to scrape: one thread serves every connection at once (up to
// 64; past that the oldest is dropped), reading each request and then
// writing its answer as the socket takes it, and closes each once
// answered. Anything else is 404; a request that does not arrive within two
// seconds or 8 KiB is dropped, and so is an answer not taken within five.
#pragma once

#include <atomic>
#include <chrono>
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
  // Scrapes (GET /metrics) begun so far, each numbered from 1 as its answer
  // is rendered, and the number of the last one answered: a server that
  // must be seen before it exits waits until a scrape begun after the
  // event has been answered (or given up on: its client read nothing).
  uint64_t scrapes_begun() const { return scrapes_begun_.load(std::memory_order_acquire); }
  uint64_t last_scrape_answered() const { return last_answered_.load(std::memory_order_acquire); }
  // Waits until a scrape begun after the first `begun` has been answered
  // (one begun before an event may not show it), or until `give_up`.
  // Whether one was.
  bool WaitForScrapeAfter(uint64_t begun, std::chrono::steady_clock::time_point give_up) const;

 private:
  MetricsServer(int fd, int port, const metrics::Registry* registry);
  void Serve();

  const int fd_;
  const int port_;
  const metrics::Registry* const registry_;
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> scrapes_begun_{0};
  std::atomic<uint64_t> last_answered_{0};
  std::thread thread_;
};

}  // namespace shardopt
