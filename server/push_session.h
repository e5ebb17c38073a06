// One rank's push of one step to this server, and the barrier it ends at:
// Begin, any number of Add, then Finish, which waits for the other ranks.
// The chunks are folded into the round's running sum in rank order
// (running_sum.h), so the sum's bits do not depend on the order of arrival;
// a chunk that arrives twice counts once. Add may wait while the window of
// early chunks is full.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "server/job.h"

namespace shardopt {

class PushSession {
 public:
  // Checks the stream's first message (rank, step, initial values present)
  // and opens a session on `job`.
  static absl::StatusOr<std::unique_ptr<PushSession>> Begin(std::shared_ptr<Job> job, const v1::GradChunk& first);
  // A session that ends without an answer (refused, cancelled, broken)
  // leaves the round as if its stream never came.
  ~PushSession();
  PushSession(const PushSession&) = delete;
  PushSession& operator=(const PushSession&) = delete;

  absl::Status Add(const v1::GradChunk& chunk);
  absl::StatusOr<v1::PushResponse> Finish();

 private:
  PushSession(std::shared_ptr<Job> job, uint64_t step, uint32_t rank);
  // Joins the round of step_, starting it if needed.
  void Start(std::chrono::steady_clock::time_point now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_->mu);
  absl::StatusOr<v1::PushResponse> Seal();
  absl::Status Take(const v1::GradChunk& chunk);
  // The answer to a push whose round ended without it.
  absl::Status Discarded() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_->mu);
  // The answer to the push of a sealed step: the job's kept sums.
  v1::PushResponse Answer() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_->mu);

  const std::shared_ptr<Job> job_;
  const uint64_t step_;
  const uint32_t rank_;
  uint64_t epoch_ = 0;    // the barrier round this session's chunks belong to
  uint64_t session_ = 0;  // this stream's number among the rank's in the round
  bool started_ = false;
  bool answered_ = false;
  bool refused_ = false;  // Add or Finish answered an error
  std::vector<std::string> no_grad_;
};

}  // namespace shardopt
