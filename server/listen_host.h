// What --host names: an address or a name to listen on, an IPv6 address
// with or without its brackets ("::1", "[::1]"), never a port.
#pragma once

#include <string>

#include "absl/status/status.h"

namespace shardopt {

// The host without the brackets an IPv6 address may come in, for
// getaddrinfo and inet_pton.
std::string BareHost(const std::string& host);

// host:port as gRPC parses it: an IPv6 address in brackets, or its last
// group would be taken for the port ("::1:0").
std::string HostPort(const std::string& host, int port);

// An address, not a name that merely starts like one ("127.example.com"):
// 127.0.0.0/8, ::1 (also v4-mapped 127/8), or localhost.
bool IsLoopback(const std::string& host);

// INVALID_ARGUMENT for a host with a port in it ("127.0.0.1:5", "[::1]:5"),
// which was taken for part of an IPv6 address: refused for plaintext, the
// wrong reason, or with --insecure a start that failed to listen.
absl::Status CheckHostHasNoPort(const std::string& host);

}  // namespace shardopt
