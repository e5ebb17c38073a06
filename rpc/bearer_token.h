// What a bearer token may hold, checked alike by the client (before it
// sends one) and by the server (in its tokens file): the bytes an HTTP/2
// header carries, printable ASCII without the space. A token with any other
// byte cannot be sent (gRPC aborts the process on such a header value), so
// a server that loaded one would never match it.
#pragma once

namespace shardopt {

inline bool SendableTokenByte(char c) { return c >= 0x21 && c <= 0x7e; }

}  // namespace shardopt
