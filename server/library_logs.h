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

}  // namespace shardopt
