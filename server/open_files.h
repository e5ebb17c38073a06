// The server's open file descriptors against its limit. Every connection
// holds one, and so does each checkpoint file being written: a server at
// its limit refuses checkpoints ("Too many open files") while idle
// connections hold the rest (an outside probe). gRPC 1.51 has no cap on
// connections, so the limit is raised as far as it goes at start, and both
// numbers are exported for an alert.
#pragma once

#include <cstdint>

namespace shardopt {

// Raises the soft RLIMIT_NOFILE to the hard one (systemd's default soft
// limit is 1024, its hard one 524288); returns the soft limit now.
uint64_t RaiseOpenFileLimit();

// The soft limit now, and the descriptors open now (/proc/self/fd's
// entries; 0 where it cannot be read).
uint64_t OpenFileLimit();
uint64_t OpenFiles();

}  // namespace shardopt
