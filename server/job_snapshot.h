// A job's state at a step boundary as a checkpoint part (checkpoint/format.h
// owns the bytes' layout), and back.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "checkpoint/format.h"
#include "server/job.h"

namespace shardopt {

// This server's part of a checkpoint under `root`: the state at the last
// step done, copied into the part's writer, whose thread is writing it out
// meanwhile. The caller holds the lock only for the copies, and finishes the
// writer after letting go of it. Never while a step is being applied piece
// by piece.
absl::StatusOr<std::unique_ptr<checkpoint::PartWriter>> Snapshot(const Job& job, const std::string& root)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu);

// The inverse of Snapshot, on a fresh job: the state of checkpoint `step`
// (0: the newest complete one) streamed from disk into the job's state.
// NOT_FOUND when there is none. On any error the job's state is partly
// written and the job must be thrown away.
absl::Status Restore(const std::string& root, uint64_t step, const checkpoint::Log& log, Job& job)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu);

}  // namespace shardopt
