#include "server/listen_host.h"

#include <arpa/inet.h>

#include "absl/strings/str_cat.h"

namespace shardopt {

std::string BareHost(const std::string& host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') return host.substr(1, host.size() - 2);
  return host;
}

std::string HostPort(const std::string& host, int port) {
  const std::string bare = BareHost(host);
  return bare.find(':') == std::string::npos ? absl::StrCat(bare, ":", port) : absl::StrCat("[", bare, "]:", port);
}

bool IsLoopback(const std::string& host) {
  const std::string bare = BareHost(host);
  in_addr v4;
  if (inet_pton(AF_INET, bare.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6;
  if (inet_pton(AF_INET6, bare.c_str(), &v6) == 1) {
    return IN6_IS_ADDR_LOOPBACK(&v6) || (IN6_IS_ADDR_V4MAPPED(&v6) && v6.s6_addr[12] == 127);
  }
  return bare == "localhost";
}

absl::Status CheckHostHasNoPort(const std::string& host) {
  // Else read as no host at all: gRPC's "unparseable host:port" at the bind.
  if (host.empty()) return absl::InvalidArgumentError("--host is empty: give an address or a name (e.g. 127.0.0.1)");
  const std::string bare = BareHost(host);
  if (bare.find(':') == std::string::npos) return absl::OkStatus();
  in6_addr v6;
  // A link-local address's zone ("fe80::1%eth0") is gRPC's to read.
  if (inet_pton(AF_INET6, bare.substr(0, bare.find('%')).c_str(), &v6) == 1) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--host takes an address or a name without a port (the port is --port), got '", host, "'"));
}

}  // namespace shardopt
