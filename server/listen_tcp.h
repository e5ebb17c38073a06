// A listening TCP socket of our own, where gRPC's would not say why it
// failed: the metrics port listens through it, and the gRPC port's failed
// start asks it for the reason ("Address already in use").
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace shardopt {

// A socket listening on host:port (port 0: an ephemeral one; host a name
// or an address, an IPv6 one with or without brackets). UNAVAILABLE whose
// message is the system's reason alone if it cannot bind or listen (the
// caller says what was asked); INVALID_ARGUMENT if the host does not
// resolve. The caller closes the descriptor.
absl::StatusOr<int> ListenTcp(const std::string& host, int port, int backlog);

// Why gRPC could not listen on `address` (HOST:PORT): the reason a socket of
// our own meets there ("Address already in use", "Cannot assign requested
// address", "cannot resolve HOST (...)"), or "" if it meets none (the port
// came free, or the cause was elsewhere).
std::string WhyCannotListen(const std::string& address);

}  // namespace shardopt
