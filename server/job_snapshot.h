// A job's state at a step boundary as a checkpoint part (checkpoint/format.h
// owns the bytes' layout), and back.
#pragma once

#include "absl/status/statusor.h"
#include "checkpoint/format.h"
#include "server/job.h"

namespace shardopt {

// This server's part of a checkpoint: the state at the last step done.
// Never while a step is being applied piece by piece.
absl::StatusOr<checkpoint::Part> Snapshot(const Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu);

// The inverse of Snapshot, on a fresh job whose spec is the part's.
absl::Status Restore(const checkpoint::Part& part, Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu);

}  // namespace shardopt
