// What the client refuses of its caller's options before any server is
// asked: what the servers would refuse too, or what no server could make
// sense of (a server listed twice, an enum value that names nothing).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "shardopt/client.h"

namespace shardopt {

// Connect's: each server listed once.
absl::Status CheckClientOptions(const ClientOptions& options);
// CreateOrAttach's: a name, tensors of numel in [1, 2^40] (rpc/job_limits.h,
// as the servers check it, before the placement's arithmetic), a world_size
// of at least 1 that holds `rank`, enum values that name something.
absl::Status CheckJobOptions(const JobOptions& job, uint32_t rank);
// Step's, before its push: refused after it, by the servers at the commit,
// the step could never go through (and a negative loss scale would move the
// params the wrong way).
absl::Status CheckStepOptions(const StepOptions& options);

}  // namespace shardopt
