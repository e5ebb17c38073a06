// What a step's caller is told when the checkpoint that checkpoint_every
// asked for after the step failed: the step itself was applied, so the
// caller's way out of a failed step, calling it again, would here apply the
// next step with the same gradients. Client::Step and NodeGroup::Step.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace shardopt {

inline absl::Status CheckpointAfterStepFailed(uint64_t step, const absl::Status& failed) {
  return absl::Status(failed.code(), absl::StrCat("step ", step, " was applied and its params returned (step() is ",
                                                  step, "; do not repeat it), but its checkpoint (checkpoint_every) "
                                                  "failed; call Checkpoint() for it: ",
                                                  failed.message()));
}

}  // namespace shardopt
