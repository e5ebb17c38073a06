// A job's checkpoint directory beyond the parts a checkpoint writes and a
// restore reads (checkpoint/format.h): marks of lives dropped on purpose,
// pruning to the newest complete checkpoints, and setting aside the steps
// and parts of a run that another has replaced. Each keeps the directory a
// restore can trust: nothing complete is removed but by a prune, and what
// is set aside is renamed, never deleted.
#pragma once

#include <cstdint>
#include <utility>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "checkpoint/format.h"

namespace shardopt::checkpoint {

// A life of a job (CreateJobResponse.incarnation) dropped on purpose, marked
// in the job's directory: a job made again after the server restarted must
// not restore the dropped life from a checkpoint, or that life's trainers
// would go on in it. Nothing to mark where the job has no directory (no
// checkpoint of it to restore).
absl::Status MarkLifeDropped(const std::string& root, const std::string& job, uint64_t incarnation);
bool LifeDropped(const std::string& root, const std::string& job, uint64_t incarnation);
// Whether a file name in a job's directory is such a mark.
bool IsDroppedLifeMark(std::string_view file_name);

// Keeps the `keep` newest complete checkpoints of the job (keep >= 1) and
// removes every older step directory, complete or torn. Steps newer than the
// newest complete one may be in progress and are never touched, so the
// newest complete checkpoint always stays. Returns the directories removed.
std::vector<std::string> Prune(const std::string& root, const std::string& job, uint64_t keep);

// A restore_step older than the newest complete checkpoint starts a new
// run of the job from it, and the job's step directories newer than `step`
// hold the old run's steps: a complete one would be taken for the new
// run's (its step skipped as complete already, and loaded as the newest),
// and a torn one could be tiled with the new run's part of that step. Each
// is renamed to "abandoned-step-<step, 20 digits>-<nanoseconds>" beside
// them: kept for the operator, never loaded or pruned. Nothing when no
// newer step is complete (`step` is then the newest). Returns what was
// done, for the log; INTERNAL if a directory could not be moved.
absl::StatusOr<std::vector<std::string>> SetAsideNewerSteps(const std::string& root, const std::string& job,
                                                            uint64_t step);

// A server whose job goes on from step `step` (restored from it, or made
// afresh at 0) runs a new run of its part: its own part in a newer torn
// step is another run's (written before this server restarted, or by the
// state it was dropped with), and the new run's parts of that step, written
// beside it by its peers, would be tiled with it into a COMMIT of two runs.
// Each such part (`spec`'s placement's file) is renamed to
// "abandoned-<step directory>-<part>-<nanoseconds>" in the job's
// directory: kept, never loaded or pruned. Peers' parts stay. Call it only
// once no server of the job can hold the run the part is of (JobStore: at
// the job's first seal); before that, a peer may still complete the part's
// step with it. `log` is told of each part as it is moved; INTERNAL if one
// could not be.
// The torn steps (no COMMIT) at or after `step` whose directory holds
// `spec`'s placement's part, steps that peers may still complete: (step,
// life that wrote the part, 0 where its head cannot be read), newest first.
std::vector<std::pair<uint64_t, uint64_t>> OwnTornParts(const std::string& root, const v1::CreateJobRequest& spec,
                                                        uint64_t step);

absl::Status SetAsideOwnNewerParts(const std::string& root, const v1::CreateJobRequest& spec, uint64_t step,
                                   const Log& log);

// Initial values written at `step` (0) into a job whose state that step's
// checkpoint holds (restored from it, or written by this server) change the
// state: the checkpoint is no longer the job's, and a restart would restore
// the values from before the write. Its COMMIT and this server's part
// (`spec`'s placement's) are renamed as SetAsideOwnNewerParts renames, the
// COMMIT first, so that the step is torn: never loaded, and completed again
// only with this server's new part (peers whose state is unchanged keep
// theirs). Nothing where neither is there. INTERNAL or FAILED_PRECONDITION
// (ErrnoStatus) if one could not be moved.
absl::Status SetAsideStepOfOldValues(const std::string& root, const v1::CreateJobRequest& spec, uint64_t step,
                                     const Log& log);

}  // namespace shardopt::checkpoint
