#include "server/listen_tcp.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace shardopt {

absl::StatusOr<int> ListenTcp(const std::string& host, int port, int backlog) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* found = nullptr;
  absl::string_view bare = host;
  if (absl::ConsumePrefix(&bare, "[")) absl::ConsumeSuffix(&bare, "]");
  const std::string name(bare);
  if (const int failed = getaddrinfo(name.c_str(), absl::StrCat(port).c_str(), &hints, &found);
      failed != 0 || found == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot resolve ", host, failed != 0 ? absl::StrCat(" (", gai_strerror(failed), ")") : ""));
  }
  const int fd = socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  const int one = 1;
  if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  const bool bound = fd >= 0 && bind(fd, found->ai_addr, found->ai_addrlen) == 0 && listen(fd, backlog) == 0;
  const int error = errno;
  freeaddrinfo(found);
  if (!bound) {
    if (fd >= 0) close(fd);
    return absl::UnavailableError(std::strerror(error));
  }
  return fd;
}

std::string WhyCannotListen(const std::string& address) {
  const size_t colon = address.rfind(':');
  int port = 0;
  // Port 0 too: a host that does not resolve, or is no address of this
  // machine, fails an ephemeral port's bind as well.
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port)) return "";
  absl::StatusOr<int> fd = ListenTcp(address.substr(0, colon), port, 1);
  if (fd.ok()) {
    close(*fd);
    return "";
  }
  return std::string(fd.status().message());
}

}  // namespace shardopt
