// A TCP proxy on loopback that can turn the connections open through it
// into black holes: they stay open and take nothing more either way, as a
// peer does whose machine died or whose network path went away without a
// reset. Connections made after go through. For tests of what a client
// does when a connection stops answering.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace shardopt::testing {

class BlackholeProxy {
 public:
  // Listens on an ephemeral loopback port, forwarding to 127.0.0.1:upstream_port.
  explicit BlackholeProxy(int upstream_port);
  ~BlackholeProxy();
  BlackholeProxy(const BlackholeProxy&) = delete;
  BlackholeProxy& operator=(const BlackholeProxy&) = delete;

  int port() const { return port_; }
  // Every connection open now forwards nothing more, and is kept open.
  void BlackholeOpenConnections();
  // How many connections the proxy has made, and how many of them the
  // upstream server has closed.
  int Connections();
  int UpstreamsClosed();

 private:
  struct Connection {
    int client = -1, upstream = -1;
    std::atomic<bool> dead{false};
    std::thread pump;
  };
  void Accept();
  void Pump(Connection* c);

  const int upstream_port_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::vector<std::unique_ptr<Connection>> connections_;  // guarded by mu_
  std::thread acceptor_;
};

}  // namespace shardopt::testing
