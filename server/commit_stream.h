// Commit: applies step t once, and streams the params of step t to every
// caller. The update runs piece by piece in stream order, so that a piece's
// params go out while the next piece is computed; every commit of the step
// applies the next piece if nobody has yet, so no rank waits on another's
// reader. Pieces start on kApplyAlignment boundaries: the bits equal one
// whole-shard update.
#pragma once

#include <cstdint>
#include <functional>

#include "absl/status/status.h"
#include "server/job.h"

namespace shardopt {

struct CommitOptions {
  uint64_t piece_elements = 0;  // elements per streamed piece, a multiple of kApplyAlignment
  bool draining = false;        // SIGTERM: no new step may start applying
};

// `emit` runs without the job's lock; returning false stops the stream (the
// step is still completed, so it never stays half applied).
absl::Status CommitAndStream(Job& job, const v1::CommitRequest& request, const CommitOptions& options,
                             const std::function<bool(const v1::ParamChunk&)>& emit) ABSL_LOCKS_EXCLUDED(job.mu);

}  // namespace shardopt
