// What a step's caller is told when the step went partly through, so that
// calling it again, the way out of a failed step, would do harm. For
// Client::Step, NodeGroup::Step and RemoteAdamW (through the extension).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/shortest_number.h"
#include "shardopt/client.h"

namespace shardopt {

// A server lost the step's push (it restarted), the step was pushed again,
// and the answers decide it otherwise than the first push's did: another
// rank pushed other gradients. The other servers may have applied the first
// decision, and a call again would apply the new one on the restarted one.
inline absl::Status RepushDecidedOtherwise(uint64_t step, float first_gscale, const Decision& redecided) {
  return absl::FailedPreconditionError(absl::StrCat(
      "step ", step, " was pushed again to a server that restarted and lost its push, and the answers now decide "
      "it otherwise (", redecided.skip ? "a skip" : absl::StrCat("gscale ", ShortestNumber(redecided.gscale)),
      " where gscale ", ShortestNumber(first_gscale), " may have been applied on the other servers): another rank "
      "pushed other gradients for it, and nothing more was committed. Calling Step again would apply the new "
      "decision there: drop the job and attach with restore_step at its last checkpoint"));
}

// The checkpoint that checkpoint_every asked for after the step failed: the
// step itself was applied, so calling it again would apply the next step
// with the same gradients. `server_lost`: a server cannot go on with the job
// (it restarted and lost steps, or its part: the failure says which and
// what to do), so a Checkpoint() of the step cannot be written either.
inline absl::Status CheckpointAfterStepFailed(uint64_t step, const absl::Status& failed, bool server_lost = false) {
  return absl::Status(failed.code(),
                      absl::StrCat("step ", step, " was applied and its params returned (step() is ", step,
                                   "; do not repeat it), but its checkpoint (checkpoint_every) failed; ",
                                   server_lost ? "no Checkpoint() can write it while a server cannot go on with the "
                                                 "job, as follows"
                                               : "call Checkpoint() for it, unless what follows says a "
                                                 "server lost steps or its part (then do what it says)",
                                   ": ", failed.message()));
}

}  // namespace shardopt
