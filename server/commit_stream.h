// Commit: applies step t once, and streams the params of step t to every
// caller. The update runs piece by piece in stream order, so that a piece's
// params go out while the next piece is computed; every commit of the step
// applies the next piece if nobody has yet, so no rank waits on another's
// reader. Pieces start on kApplyAlignment boundaries: the bits equal one
// whole-shard update.
#pragma once

#include <cstdint>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"

#include "absl/status/status.h"
#include "server/job.h"

namespace shardopt {

struct CommitOptions {
  uint64_t piece_elements = 0;  // elements per streamed piece, a multiple of kApplyAlignment
  bool draining = false;        // SIGTERM: no new step may start applying, but a sealed round's (Job::drain_taken)
};

// One commit's params, pulled piece by piece: each Next applies its piece
// if it is the next one to apply, then holds the piece's params where they
// lie (JobState::HoldState: the CPU's bf16 params are not copied), so that
// a transport sends them as they are. The gRPC service's callback reactor
// drives it; CommitAndStream is the blocking loop over it. Takes the job's
// lock inside each call.
class ParamStream {
 public:
  // One piece's params: what a ParamChunk carries, its bytes held.
  struct Piece {
    uint64_t step;
    const std::string* tensor;  // the job's, alive as long as the job
    uint64_t offset;            // in the tensor, elements
    bool fp32;                  // FP32 params (the master itself), else bf16
    Pieces data;                // unchanged while held, whatever the job does
  };

  // Checks the commit and starts applying its step if this is the step's
  // first commit. While a checkpoint streams the state, a commit that would
  // start applying waits for it (Job::StateWritable): with a null `wake`
  // here; otherwise Open returns null at once and runs `wake` when it is
  // time to call it again.
  static absl::StatusOr<std::unique_ptr<ParamStream>> Open(std::shared_ptr<Job> job, const v1::CommitRequest& request,
                                                           const CommitOptions& options,
                                                           const std::function<void()>& wake);
  // A stream not read to the end is abandoned: the rest of the step is
  // applied, so it never stays half applied.
  ~ParamStream();

  // The next piece; nullopt after the last. After an error there is no
  // next piece.
  absl::StatusOr<std::optional<Piece>> Next();
  // The caller stops reading: applies what is left of the step.
  absl::Status Abandon();

 private:
  struct Walk;
  ParamStream() = default;
  std::unique_ptr<Walk> walk_;
  uint64_t next_ = 0;
  std::chrono::steady_clock::time_point started_;
};

// `emit` runs without the job's lock; returning false stops the stream (the
// step is still completed, so it never stays half applied).
absl::Status CommitAndStream(std::shared_ptr<Job> job, const v1::CommitRequest& request, const CommitOptions& options,
                             const std::function<bool(const v1::ParamChunk&)>& emit);

}  // namespace shardopt
