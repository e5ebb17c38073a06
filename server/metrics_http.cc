#include "server/metrics_http.h"

#include <arpa/inet.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/listen_tcp.h"

namespace shardopt {
namespace {

// A client that stops reading its answer gets until this deadline, then is
// dropped, so it holds neither the server's exit nor its answer's memory
// for longer; the other connections are served meanwhile.
constexpr auto kSendTime = std::chrono::seconds(5);

// A request's head arrives within this time, and this size, or the
// connection is dropped unanswered.
constexpr auto kHeadTime = std::chrono::seconds(2);
constexpr size_t kHeadBytes = 8192;
// Connections served at once: past it, the one open longest is dropped.
constexpr size_t kConnections = 64;
// Answers held unsent, in all: past it, the connections open longest are
// dropped (a scrape is taken in milliseconds by a reader that reads).
constexpr uint64_t kPendingBytes = uint64_t{64} << 20;

// Whether a request is a scrape: GET of the metrics path.
bool IsScrape(const std::string& head) {
  return absl::StartsWith(head, "GET /metrics ") || absl::StartsWith(head, "GET /metrics?");
}

// The answer to a request whose head is `head` (whole, or cut at kHeadBytes).
std::string Answer(const std::string& head, const metrics::Registry& registry) {
  const bool get = IsScrape(head);
  if (!get && !absl::StartsWith(head, "HEAD /metrics ") && !absl::StartsWith(head, "HEAD /metrics?")) {
    // Another method on the metrics path is the wrong method, not a path
    // that is not there.
    const size_t space = head.find(' ');
    const absl::string_view target = space == std::string::npos ? "" : absl::string_view(head).substr(space + 1);
    if (absl::StartsWith(target, "/metrics ") || absl::StartsWith(target, "/metrics?")) {
      return "HTTP/1.1 405 Method Not Allowed\r\nAllow: GET, HEAD\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
    }
    return "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
  }
  const std::string body = registry.Render();
  return absl::StrCat("HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                      "Content-Length: ", body.size(), "\r\nConnection: close\r\n\r\n", get ? body : "");
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& host, int port,
                                                                     const metrics::Registry* registry) {
  absl::StatusOr<int> listening = ListenTcp(host, port, 16);
  if (!listening.ok()) {
    return absl::Status(listening.status().code(),
                        absl::IsUnavailable(listening.status())
                            ? absl::StrCat("--metrics_port: cannot listen on ", host, ":", port, ": ",
                                           listening.status().message())
                            : absl::StrCat("--metrics_port: ", listening.status().message()));
  }
  const int fd = *listening;
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const int chosen = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                                      : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  return std::unique_ptr<MetricsServer>(new MetricsServer(fd, chosen, registry));
}

bool MetricsServer::WaitForScrapeAfter(uint64_t begun, std::chrono::steady_clock::time_point give_up) const {
  while (last_scrape_answered() <= begun && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return last_scrape_answered() > begun;
}

MetricsServer::MetricsServer(int fd, int port, const metrics::Registry* registry)
    : fd_(fd), port_(port), registry_(registry), thread_([this] { Serve(); }) {}

MetricsServer::~MetricsServer() {
  stop_ = true;
  thread_.join();
  close(fd_);
}

void MetricsServer::Serve() {
  // Every connection is served at once, its head read and then its answer
  // written as the socket takes it: one that sends nothing (a port scan, a
  // stuck client), or asks and reads nothing, holds up no scrape. (Answers
  // were written whole, one at a time: a client that asked and never read
  // held every scrape behind it for 5 s, an outside probe's ten for 30 s.)
  struct Connection {
    int fd;
    std::string head;
    std::string answer;  // once the head is whole; sent from `sent` on
    size_t sent = 0;
    uint64_t scrape = 0;  // its number, if it is a scrape
    std::chrono::steady_clock::time_point give_up;
  };
  // Sends what the socket takes now; whether the connection is done with.
  const auto send_some = [](Connection& c) {
    const ssize_t n = send(c.fd, c.answer.data() + c.sent, c.answer.size() - c.sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) c.sent += static_cast<size_t>(n);
    return c.sent == c.answer.size() || (n < 0 && errno != EAGAIN && errno != EINTR) || n == 0;
  };
  // Closes a connection: a scrape is answered if all of its answer went out
  // (one given up on was seen by nobody, which the drain's wait for a
  // scrape must not count). Scrapes end out of turn, so the last answered
  // is the highest.
  const auto end = [this](const Connection& c) {
    if (c.sent != c.answer.size()) {
      // Given up on: reset, not closed after what the socket still holds,
      // which would keep it (and its buffer) for as long as nobody reads.
      const linger reset{1, 0};
      setsockopt(c.fd, SOL_SOCKET, SO_LINGER, &reset, sizeof reset);
    }
    close(c.fd);
    if (c.scrape == 0 || c.sent != c.answer.size()) return;
    uint64_t last = last_answered_.load(std::memory_order_acquire);
    while (c.scrape > last && !last_answered_.compare_exchange_weak(last, c.scrape, std::memory_order_acq_rel)) {
    }
  };
  std::vector<Connection> open;
  while (!stop_) {
    std::vector<pollfd> polled = {{fd_, POLLIN, 0}};
    for (const Connection& c : open) polled.push_back({c.fd, static_cast<short>(c.answer.empty() ? POLLIN : POLLOUT), 0});
    if (poll(polled.data(), polled.size(), 200) < 0) continue;  // wakes to see stop_
    const auto now = std::chrono::steady_clock::now();
    std::vector<Connection> still;
    for (size_t i = 0; i < open.size(); ++i) {
      Connection& c = open[i];
      const short events = polled[i + 1].revents;
      bool done = now >= c.give_up;
      if (!done && !c.answer.empty() && (events & (POLLOUT | POLLHUP | POLLERR)) != 0) {
        done = send_some(c);
      } else if (!done && c.answer.empty() && (events & (POLLIN | POLLHUP | POLLERR)) != 0) {
        char buf[1024];
        const ssize_t n = recv(c.fd, buf, sizeof buf, 0);
        if (n > 0) c.head.append(buf, static_cast<size_t>(n));
        done = n <= 0;
        if (n > 0 && (c.head.find("\r\n\r\n") != std::string::npos || c.head.size() >= kHeadBytes)) {
          c.scrape = IsScrape(c.head) ? scrapes_begun_.fetch_add(1, std::memory_order_acq_rel) + 1 : 0;
          c.answer = Answer(c.head, *registry_);
          c.give_up = now + kSendTime;
          done = send_some(c);
        }
      }
      if (!done) {
        still.push_back(std::move(c));
        continue;
      }
      end(c);
    }
    open = std::move(still);
    // What of the answers is not sent yet: past kPendingBytes the oldest
    // go (never the newest alone), so that clients that ask and read
    // nothing cannot make the server hold an answer each (64 of a few MB).
    uint64_t pending = 0;
    for (const Connection& c : open) pending += c.answer.size() - c.sent;
    for (auto it = open.begin(); pending > kPendingBytes && it != open.end();) {
      const uint64_t unsent = it->answer.size() - it->sent;
      if (unsent == 0 || unsent == pending) {
        ++it;
        continue;
      }
      pending -= unsent;
      end(*it);
      it = open.erase(it);
    }
    if ((polled[0].revents & POLLIN) != 0) {
      const int conn = accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (conn >= 0) {
        if (open.size() >= kConnections) {
          end(open.front());
          open.erase(open.begin());
        }
        open.push_back({conn, "", "", 0, 0, now + kHeadTime});
      }
    }
  }
  for (const Connection& c : open) end(c);
}

}  // namespace shardopt
