// The server's words, in its ABORTED refusal of a commit whose step another
// commit applied, or skipped, the other way (CommitArgs::FirstDifference):
// an overlap rank whose commit lost so to the other ranks' takes the step
// as the servers hold it (python/shardopt/_overlap.py).
#pragma once

namespace shardopt {

// A commit asked to skip a step that another commit applied or is applying.
inline constexpr char kAppliedAskedSkipped[] = "applied -> skipped";
// A commit asked to apply a step that another commit skipped.
inline constexpr char kSkippedAskedApplied[] = "skipped -> applied";

}  // namespace shardopt
