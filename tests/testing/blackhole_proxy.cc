#include "tests/testing/blackhole_proxy.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>

namespace shardopt::testing {
namespace {

sockaddr_in Loopback(int port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  return addr;
}

}  // namespace

BlackholeProxy::BlackholeProxy(int upstream_port) : upstream_port_(upstream_port) {
  listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr = Loopback(0);
  socklen_t length = sizeof addr;
  if (listen_fd_ < 0 || bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      listen(listen_fd_, 64) != 0 || getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &length) != 0) {
    std::abort();  // loopback sockets are the test machine's; nothing to go on without them
  }
  port_ = ntohs(addr.sin_port);
  acceptor_ = std::thread([this] { Accept(); });
}

BlackholeProxy::~BlackholeProxy() {
  stop_ = true;
  acceptor_.join();
  close(listen_fd_);
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& c : connections_) {
    // A pump blocked in a write (its reader gone quiet) returns.
    shutdown(c->client, SHUT_RDWR);
    shutdown(c->upstream, SHUT_RDWR);
    c->pump.join();
    close(c->client);
    close(c->upstream);
  }
}

void BlackholeProxy::BlackholeOpenConnections() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& c : connections_) c->dead = true;
}

int BlackholeProxy::Connections() {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(connections_.size());
}

int BlackholeProxy::UpstreamsClosed() {
  std::lock_guard<std::mutex> lock(mu_);
  int closed = 0;
  for (auto& c : connections_) {
    pollfd p{c->upstream, POLLRDHUP, 0};  // the server's FIN, whatever it sent before that lies unread
    if (poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) ++closed;
  }
  return closed;
}

void BlackholeProxy::Accept() {
  while (!stop_) {
    pollfd p{listen_fd_, POLLIN, 0};
    if (poll(&p, 1, 50) <= 0) continue;
    const int client = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (client < 0) continue;
    const int upstream = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const sockaddr_in to = Loopback(upstream_port_);
    if (upstream < 0 || connect(upstream, reinterpret_cast<const sockaddr*>(&to), sizeof to) != 0) {
      close(client);
      if (upstream >= 0) close(upstream);
      continue;
    }
    auto c = std::make_unique<Connection>();
    c->client = client;
    c->upstream = upstream;
    Connection* raw = c.get();
    std::lock_guard<std::mutex> lock(mu_);
    raw->pump = std::thread([this, raw] { Pump(raw); });
    connections_.push_back(std::move(c));
  }
}

void BlackholeProxy::Pump(Connection* c) {
  char buffer[64 * 1024];
  while (!stop_ && !c->dead) {
    pollfd p[2] = {{c->client, POLLIN, 0}, {c->upstream, POLLIN, 0}};
    if (poll(p, 2, 50) <= 0) continue;
    for (int i = 0; i < 2; ++i) {
      if ((p[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
      const ssize_t n = read(p[i].fd, buffer, sizeof buffer);
      if (n <= 0) return;  // a side closed: the other end learns so when the proxy goes
      const int to = i == 0 ? c->upstream : c->client;
      for (ssize_t done = 0; done < n;) {
        // MSG_NOSIGNAL: a peer gone is an error here, not SIGPIPE for the test.
        const ssize_t w = send(to, buffer + done, static_cast<size_t>(n - done), MSG_NOSIGNAL);
        if (w <= 0) return;
        done += w;
      }
    }
  }
}

}  // namespace shardopt::testing
