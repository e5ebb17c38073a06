// One rank's push of one step to this server, and the barrier it ends at:
// Begin, any number of chunks, then the seal, which waits for the other
// ranks. The chunks are folded into the round's running sum in rank order
// (running_sum.h), so the sum's bits do not depend on the order of arrival;
// a chunk that arrives twice counts once.
//
// Two ways to wait. Offer/Resume and TrySeal never block: when the window of
// early chunks is full, or the barrier is not yet reached, they answer
// "waiting" and call `wake` (on the job's wakeup thread) once something may
// have changed or the round's deadline is reached; the caller then calls
// Resume or TrySeal again. The gRPC service waits this way, so a waiting
// stream holds no thread. Add and Finish block the calling thread, for
// callers that have one to spare (tests, in-process tools).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "base/pieces.h"
#include "server/grad_part.h"
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

  using Wake = std::function<void()>;
  // Takes a message's chunk, its data apart from the other fields (so that
  // it can stay in the transport's buffers; `head`'s own data is ignored),
  // then the chunks packed after it (GradChunk.more), in order, as if each
  // came alone: true once all are dealt with; false while part of one waits
  // for room in the window, the rest after it (then call Resume after
  // `wake`). An error refuses the chunk; the stream must then end.
  absl::StatusOr<bool> Offer(v1::GradChunk head, Pieces data, std::vector<GradPart> more, const Wake& wake);
  absl::StatusOr<bool> Resume(const Wake& wake);
  // Ends the rank's push and answers once the round is sealed; nullopt while
  // it waits at the barrier (then call TrySeal again after `wake`).
  absl::StatusOr<std::optional<v1::PushResponse>> TrySeal(const Wake& wake);

  // The deadline of the round the session joined, if it joined one yet; a
  // time long passed once that round is over (sealed and committed, or
  // ended at its deadline by another push's wait).
  std::optional<std::chrono::steady_clock::time_point> RoundDeadline() const;
  // OK while the session's round may still take its chunks; once the round
  // ended without it (its deadline passed: then it ends here, for every
  // rank), the answer its push gets. A stream still sending at the barrier
  // deadline is cut with it.
  absl::Status CheckRound();

  // Whether the stream may read its next message now (Job::held_bytes):
  // true, counting the message's expected size as held until it arrives;
  // false, and `wake` runs when it is worth asking again. An error if the
  // round the stream joined has ended without it (its answer).
  absl::StatusOr<bool> MayRead(const Wake& wake);

  // Whether the stream may start reading its next message before offering
  // the one it has: only while its rank is the lowest unfinished one of the
  // round, whose chunks fold at once and never wait for the window
  // (running_sum.h). If so, that read counts as held from now on, as
  // MayRead's would, and the Offer that follows never waits.
  bool ReadAhead();

  // How many no_grad names the stream may still send.
  uint64_t no_grad_names_left() const;
  // How many chunks a message may pack (GradChunk.more): the job's tensors.
  uint64_t packed_chunks_allowed() const;

  // The stream was refused outside the session (a message that does not
  // parse): its chunks leave the round as a refused push's do.
  void Refuse() { refused_ = true; }

  // The blocking forms of Offer and TrySeal.
  absl::Status Add(v1::GradChunk head, Pieces data);
  absl::Status Add(const v1::GradChunk& chunk);  // its data in one piece
  absl::StatusOr<v1::PushResponse> Finish();

 private:
  PushSession(std::shared_ptr<Job> job, uint64_t step, uint32_t rank, uint64_t trainer, uint64_t said_chunk);
  // Joins the round of step_, starting it if needed.
  void Start(std::chrono::steady_clock::time_point now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_->mu);
  // Under the job's lock: the first part of the seal (the rank's
  // declaration, its finish in the sum), then whether the round is sealed.
  absl::StatusOr<std::optional<v1::PushResponse>> Seal(const Wake& wake) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_->mu);
  // The rank's declaration as its push ends, checked against what it has
  // offered to the round (which must be active): [shard] whether it has no
  // gradient there. Refused if it both pushed and declared a tensor, or
  // left part of a shard out.
  absl::StatusOr<std::vector<bool>> Declared() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_->mu);
  // The refusal of a push that ended without [gap) of the shard.
  absl::Status EndedWithout(size_t shard, std::pair<uint64_t, uint64_t> gap) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_->mu);
  absl::StatusOr<std::optional<v1::PushResponse>> AwaitSeal(const Wake& wake) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_->mu);
  absl::StatusOr<bool> Take(v1::GradChunk head, Pieces data, std::vector<GradPart> more, const Wake& wake);
  // Checks a chunk and, where it is to be summed, makes it the pending one.
  absl::Status Stage(const v1::GradChunk& head, Pieces data) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_->mu);
  // Folds what it can of the pending chunk; false when the rest must wait.
  absl::StatusOr<bool> Fold(const Wake& wake) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_->mu);
  // Fold, then each queued chunk staged and folded in turn; false when one
  // must wait.
  absl::StatusOr<bool> FoldAll(const Wake& wake) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_->mu);
  // This session's part of the job's held_bytes becomes `bytes`. True if it
  // let go of some: the caller then notifies the job, so that streams that
  // wait to read look again.
  bool Hold(uint64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_->mu);
  // The size the stream's next read is counted at: the larger of what its
  // first message said its chunks carry and the largest it has sent.
  uint64_t ExpectedRead() const;
  // What the stream holds for a read in flight: one started ahead (ReadAhead)
  // while the chunk before it is taken.
  uint64_t ReadInFlight() const { return read_ahead_ ? ExpectedRead() : 0; }

  // The answer to a push whose round ended without it.
  absl::Status Discarded() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_->mu);
  // CheckRound under the job's lock.
  absl::Status CheckRoundLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_->mu);
  // The answer to the push of a sealed step: the job's kept sums.
  v1::PushResponse Answer() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_->mu);

  const std::shared_ptr<Job> job_;
  const uint64_t step_;
  const uint32_t rank_;
  const uint64_t trainer_;  // GradChunk.trainer (0: not checked)
  uint64_t epoch_ = 0;    // the barrier round this session's chunks belong to
  uint64_t session_ = 0;  // this stream's number among the rank's in the round
  bool started_ = false;
  bool answered_ = false;
  bool refused_ = false;  // Offer or TrySeal answered an error
  bool sealing_ = false;  // the rank finished in the sum: only the barrier is left
  std::vector<bool> no_grad_;  // [tensor], once the stream names any
  uint64_t no_grad_names_ = 0;  // names sent, repeats included: at most the job's tensors
  // The chunk being folded while the window is full, and how much is done.
  std::optional<Pieces> pending_;
  uint64_t pending_offset_ = 0;  // the chunk's, in the tensor
  uint64_t pending_taken_ = 0;
  uint64_t held_ = 0;           // this session's part of job_->held_bytes
  uint64_t largest_chunk_ = 0;  // the largest chunk's bytes so far (ExpectedRead)
  const uint64_t said_chunk_;   // GradChunk.chunk_bytes (0: unsaid), at most the window's cap
  bool read_ahead_ = false;     // the next read started before this chunk was taken
  DType pending_dtype_ = DType::kBf16;
  uint32_t pending_shard_ = 0;
  // The chunks packed after the pending one in its message, from
  // next_queued_ on: they follow it once it is folded. While any of the
  // message waits, the whole message is held (its bytes are alive while
  // any piece of them is): message_bytes_, its data.
  std::vector<GradPart> queued_;
  size_t next_queued_ = 0;
  uint64_t message_bytes_ = 0;

};

}  // namespace shardopt
