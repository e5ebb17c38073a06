// gRPC's and protobuf's own log lines as the server's (server/log.h): with
// --log_format=json every line of stderr is then JSON, and each line of
// their source is rate-limited, since any peer can cause one per
// connection or request (a failed TLS handshake, a string that is not
// UTF-8).
#pragma once

namespace shardopt {

// Routes both libraries' logging through log::Write. Call once, after
// log::Init.
void RouteLibraryLogs();

// Whether gRPC has said that accepting a connection failed for want of
// file descriptors ("Failed accept4: Too many open files"). gRPC 1.51's
// listener accepts nothing after that, however many descriptors are freed
// (grpc/grpc#20418; an outside probe's port stayed deaf), while
// connections already open, the health port and /metrics go on: the server
// then reports NOT_SERVING so that it is restarted (main.cc).
bool AcceptFailedForDescriptors();

}  // namespace shardopt
