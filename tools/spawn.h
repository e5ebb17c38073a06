// Starts another program from a process that has threads (gRPC's, a test's),
// for the tests' servers and the abuse bench's. Everything the child needs
// is made before the fork: until it execs, the child of a threaded process
// may make only async-signal-safe calls, and a malloc there can wait forever
// on a lock that another thread held at the fork (under ASAN, restarted test
// servers that logged nothing for 20 s were most likely children stuck so).
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace shardopt {

struct SpawnOptions {
  std::string stderr_path;   // if set, the child's stderr, truncated; else the parent's
  std::string cgroup_procs;  // if set, a cgroup.procs file the child joins before it execs
};

// Forks and execs argv[0] with `argv`, and returns the child's pid (-1 if
// the fork failed). The child is killed when the calling thread exits
// (PR_SET_PDEATHSIG follows the thread, not the process). If a file cannot
// be opened it exits 126, and 127 if the exec fails.
pid_t Spawn(std::vector<std::string> argv, const SpawnOptions& options = {});

}  // namespace shardopt
