// The server's words, in its ABORTED refusal, for a commit asking to skip a
// step that another commit applied or is applying (CommitArgs::
// FirstDifference): an overlap rank whose skip lost so to the other ranks'
// apply takes the step as applied (python/shardopt/_overlap.py).
#pragma once

namespace shardopt {

inline constexpr char kAppliedAskedSkipped[] = "applied -> skipped";

}  // namespace shardopt
