// A job's state at a step boundary as a checkpoint part (checkpoint/format.h
// owns the bytes' layout), and back.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "checkpoint/format.h"
#include "server/job.h"

namespace shardopt {

// This server's part of a checkpoint of step `step` under `root`, streamed
// from the state into the part's writer, whose thread writes it out
// meanwhile; the caller finishes the writer. Waits for a step being applied
// piece by piece to finish, so the part is at a step boundary, then calls
// `began`, whose error ends it there (a checkpoint refused once its step is
// known good). From then until it returns, nothing writes the state: the next
// step's apply and Init wait (Job::StateWritable). The job's lock is taken
// only to check the job and for each slice, so pushes go on meanwhile, and
// the writer holds a few buffers, not a copy of the state. Nothing streams
// if the step's checkpoint is complete already, or if this job wrote its
// part of the step already (Job::part_written: the file is kept). FAILED_PRECONDITION (and no
// `began`) if the job is not at `step` or lacks initial values; NOT_FOUND
// if it is dropped while streaming (the part, not finished, leaves no file).
// `after_slice`, if set, runs after each slice, without the lock.
// `array_alignment`: the part's (checkpoint::PartWriter::Open).
absl::StatusOr<std::unique_ptr<checkpoint::PartWriter>> Snapshot(Job& job, const std::string& root, uint64_t step,
                                                                 absl::Time deadline, uint32_t array_alignment,
                                                                 const std::function<absl::Status()>& began,
                                                                 const std::function<void()>& after_slice = nullptr)
    ABSL_LOCKS_EXCLUDED(job.mu);

// The inverse of Snapshot, on a fresh job: the state of checkpoint `step`
// (0: the newest complete one) streamed from disk into the job's state.
// NOT_FOUND when there is none. With `own_life` nonzero, this server's own
// part of `step` that life wrote, alone (checkpoint::LoadOwnPart). On any
// error the job's state is partly written and the job must be thrown away.
absl::Status Restore(const std::string& root, uint64_t step, const checkpoint::Log& log, Job& job,
                     uint64_t own_life = 0) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu);

}  // namespace shardopt
