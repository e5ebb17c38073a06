#include "server/metrics_http.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace shardopt {
namespace {

// One connection at a time is served: a client that stops reading gets
// until this deadline, then is dropped, so it holds neither the scrapes
// behind it nor the server's exit.
constexpr auto kSendTime = std::chrono::seconds(5);

void SendAll(int fd, const std::string& data) {
  const auto give_up = std::chrono::steady_clock::now() + kSendTime;
  for (size_t off = 0; off < data.size();) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(give_up - std::chrono::steady_clock::now());
    pollfd p{fd, POLLOUT, 0};
    if (left.count() <= 0 || poll(&p, 1, static_cast<int>(left.count())) <= 0) return;
    const ssize_t n = send(fd, data.data() + off, data.size() - off, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n <= 0) return;
    off += static_cast<size_t>(n);
  }
}

// The request's head, up to its blank line; empty if it is too slow or too big.
std::string ReadHead(int fd) {
  std::string head;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (head.find("\r\n\r\n") == std::string::npos && head.size() < 8192) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(give_up - std::chrono::steady_clock::now());
    pollfd p{fd, POLLIN, 0};
    if (left.count() <= 0 || poll(&p, 1, static_cast<int>(left.count())) <= 0) return "";
    char buf[1024];
    const ssize_t n = recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return "";
    head.append(buf, static_cast<size_t>(n));
  }
  return head;
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& host, int port,
                                                                     const metrics::Registry* registry) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  const std::string service = absl::StrCat(port);
  if (getaddrinfo(host.c_str(), service.c_str(), &hints, &found) != 0 || found == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("--metrics_port: cannot resolve ", host));
  }
  const int fd = socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  const bool bound = fd >= 0 && bind(fd, found->ai_addr, found->ai_addrlen) == 0 && listen(fd, 16) == 0;
  freeaddrinfo(found);
  if (!bound) {
    const std::string why = strerror(errno);
    if (fd >= 0) close(fd);
    return absl::UnavailableError(absl::StrCat("--metrics_port: cannot listen on ", host, ":", port, ": ", why));
  }
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const int chosen = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                                      : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  return std::unique_ptr<MetricsServer>(new MetricsServer(fd, chosen, registry));
}

MetricsServer::MetricsServer(int fd, int port, const metrics::Registry* registry)
    : fd_(fd), port_(port), registry_(registry), thread_([this] { Serve(); }) {}

MetricsServer::~MetricsServer() {
  stop_ = true;
  thread_.join();
  close(fd_);
}

void MetricsServer::Serve() {
  while (!stop_) {
    pollfd p{fd_, POLLIN, 0};
    if (poll(&p, 1, 200) <= 0) continue;  // wakes to see stop_
    const int conn = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0) continue;
    const std::string head = ReadHead(conn);
    if (absl::StartsWith(head, "GET /metrics ") || absl::StartsWith(head, "GET /metrics?")) {
      const std::string body = registry_->Render();
      SendAll(conn, absl::StrCat("HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                                 "Content-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", body));
    } else if (!head.empty()) {
      SendAll(conn, "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
    }
    close(conn);
  }
}

}  // namespace shardopt
