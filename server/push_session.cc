#include "server/push_session.h"

#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "server/job_spec.h"
#include "server/messages.h"

namespace shardopt {

absl::StatusOr<std::unique_ptr<PushSession>> PushSession::Begin(std::shared_ptr<Job> job, const v1::GradChunk& first) {
  absl::MutexLock lock(&job->mu);
  if (first.rank() >= job->world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", first.rank(), " is out of range: job '", job->name(),
                                                   "' has world_size ", job->world_size()));
  }
  const bool resealed = first.step() == job->step && job->sealed_step == job->step && job->step > 0;
  if (!resealed) {
    SHARDOPT_RETURN_IF_ERROR(job->CheckStepToPush(first.step()));
  }
  if (job->uninitialized_shards > 0) {
    for (size_t s = 0; s < job->shards.size(); ++s) {
      if (auto gap = job->init_cover[s].FirstGap(0, job->shards[s].length)) {
        return absl::FailedPreconditionError(
            absl::StrCat("tensor '", job->tensor_name(job->shards[s]), "' elements ",
                         Range(job->shards[s].offset + gap->first, job->shards[s].offset + gap->second),
                         " have no initial value; stream them with Init before step 1"));
      }
    }
  }
  return std::unique_ptr<PushSession>(new PushSession(job, first.step(), first.rank()));
}

PushSession::PushSession(std::shared_ptr<Job> job, uint64_t step, uint32_t rank)
    : job_(std::move(job)), step_(step), rank_(rank) {}

void PushSession::Start(std::chrono::steady_clock::time_point now) {
  if (!job_->round.active) job_->StartRound(now);
  epoch_ = job_->round.epoch;
  session_ = ++job_->round.sessions[rank_];
  started_ = true;
}

// Not once the rank has finished, nor when a newer stream of the rank (a
// retry) is under way. While none of the stream's chunks is in the sum yet,
// they are taken back exactly, so the rank's next stream starts afresh. Once
// some are, they cannot be: a stream that was merely cut off keeps them (its
// retry sends the same gradient, which counts once), and a refused one ends
// the round, whose pushes are then retried from the start.
PushSession::~PushSession() {
  if (!started_ || answered_) return;
  absl::MutexLock lock(&job_->mu);
  Job::Round& round = job_->round;
  if (!round.active || round.epoch != epoch_ || round.sealed || round.sum->finished(rank_) ||
      round.sessions[rank_] != session_) {
    return;
  }
  if (round.sum->Withdraw(rank_)) {
    job_->changed.SignalAll();
    return;
  }
  if (refused_) {
    job_->EndRound(absl::StrCat("rank ", rank_, "'s push was refused after part of it was summed"));
  }
}

absl::Status PushSession::Add(const v1::GradChunk& chunk) {
  absl::Status added = Take(chunk);
  refused_ = refused_ || !added.ok();
  return added;
}

absl::Status PushSession::Take(const v1::GradChunk& chunk) {
  if ((!chunk.job().empty() && chunk.job() != job_->name()) || (chunk.step() != 0 && chunk.step() != step_) ||
      (chunk.rank() != 0 && chunk.rank() != rank_)) {
    return absl::InvalidArgumentError("job, step and rank must not change within one push stream");
  }
  for (const std::string& t : chunk.no_grad()) no_grad_.push_back(t);
  const bool has_data = !chunk.tensor().empty() || !chunk.data().empty();
  absl::MutexLock lock(&job_->mu);
  SHARDOPT_RETURN_IF_ERROR(job_->CheckNotDropped());
  const auto now = std::chrono::steady_clock::now();
  job_->ExpireIfLate(now);
  if (started_ && job_->step < step_ && (job_->round.epoch != epoch_ || !job_->round.active)) return Discarded();
  if (!has_data) return absl::OkStatus();
  SHARDOPT_ASSIGN_OR_RETURN(auto dtype, FromProto(chunk.dtype()));
  SHARDOPT_RETURN_IF_ERROR(CheckDataLength(chunk.data(), dtype, "gradient chunk"));
  const uint64_t count = chunk.data().size() / DTypeSize(dtype);
  SHARDOPT_ASSIGN_OR_RETURN(auto shard, job_->LocateRange(chunk.tensor(), chunk.offset(), count));
  if (const v1::DType want = job_->grad_dtype(job_->shards[shard].tensor); ToProto(dtype) != want) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", chunk.tensor(), "' of job '", job_->name(), "' takes ",
                                                   v1::DType_Name(want), " gradients; this chunk is ",
                                                   v1::DType_Name(chunk.dtype())));
  }
  if (job_->step >= step_) return absl::OkStatus();  // a retry of a committed step: already counted
  if (!started_) Start(now);
  if (job_->round.sealed) return absl::OkStatus();  // a retry after the barrier: already counted
  // Fold what can be folded; when the window is full, wait for it to drain
  // (this stream is not read meanwhile, so gRPC holds its sender back).
  const uint64_t local = chunk.offset() - job_->shards[shard].offset;
  const uint64_t esize = DTypeSize(dtype);
  for (uint64_t taken = 0;;) {
    RunningSum& sum = *job_->round.sum;
    const uint64_t before = sum.progress();
    SHARDOPT_ASSIGN_OR_RETURN(auto offered, sum.Offer(*job_->state, rank_, shard, local + taken, dtype,
                                                      chunk.data().data() + taken * esize, count - taken));
    taken += offered.taken;
    if (sum.progress() != before) job_->changed.SignalAll();
    if (!offered.window_full) return absl::OkStatus();
    const uint64_t seen = sum.progress();
    job_->WaitUntil([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_->mu) {
      return job_->dropped || job_->round.epoch != epoch_ || job_->round.sum->progress() != seen;
    }, job_->round.deadline);
    SHARDOPT_RETURN_IF_ERROR(job_->CheckNotDropped());
    job_->ExpireIfLate(std::chrono::steady_clock::now());
    if (job_->round.epoch != epoch_) return Discarded();
  }
}

absl::Status PushSession::Discarded() const {
  return absl::DeadlineExceededError(absl::StrCat("the round of step ", step_, " ended before rank ", rank_,
                                                  "'s push did (", job_->round_end,
                                                  "); its gradients were discarded: push step ", step_, " again"));
}

absl::StatusOr<v1::PushResponse> PushSession::Finish() {
  absl::StatusOr<v1::PushResponse> answer = Seal();
  answered_ = answer.ok();
  refused_ = refused_ || !answer.ok();
  return answer;
}

v1::PushResponse PushSession::Answer() const {
  v1::PushResponse r;
  r.set_step(step_);
  r.set_sum_squares(job_->sealed_stats.sum_squares);
  r.set_nonfinite(job_->sealed_stats.nonfinite);
  return r;
}

absl::StatusOr<v1::PushResponse> PushSession::Seal() {
  absl::MutexLock lock(&job_->mu);
  SHARDOPT_RETURN_IF_ERROR(job_->CheckNotDropped());
  if (job_->step >= step_) {  // a retry of a committed step: its answer, if still kept
    if (job_->sealed_step == step_) return Answer();
    return absl::FailedPreconditionError(absl::StrCat("step ", step_, " is stale: job '", job_->name(), "' is at step ", job_->step));
  }
  const auto now = std::chrono::steady_clock::now();
  job_->ExpireIfLate(now);
  if (!started_) Start(now);
  if (job_->round.epoch != epoch_) return Discarded();
  if (job_->round.sealed) return Answer();
  RunningSum& sum = *job_->round.sum;

  // Validate the whole declaration before changing anything.
  std::vector<uint32_t> no_grad_shards;
  for (const std::string& t : no_grad_) {
    auto it = job_->tensor_index.find(t);
    if (it == job_->tensor_index.end()) {
      return absl::NotFoundError(absl::StrCat("no_grad names tensor ", Quote(t), ", which job '", job_->name(), "' lacks"));
    }
    const int64_t s = job_->shard_of_tensor[it->second];
    if (s < 0) continue;
    if (sum.FirstGap(rank_, static_cast<uint32_t>(s)) !=
        std::make_optional(std::make_pair(uint64_t{0}, job_->shards[s].length))) {
      return absl::InvalidArgumentError(absl::StrCat("rank ", rank_, " both pushed tensor '", t, "' and declared it no_grad"));
    }
    no_grad_shards.push_back(static_cast<uint32_t>(s));
  }
  std::vector<bool> no_grad(job_->shards.size(), false);
  for (uint32_t s : no_grad_shards) no_grad[s] = true;
  for (size_t s = 0; s < job_->shards.size(); ++s) {
    if (no_grad[s]) continue;
    if (auto gap = sum.FirstGap(rank_, static_cast<uint32_t>(s))) {
      return absl::FailedPreconditionError(
          absl::StrCat("rank ", rank_, "'s push of step ", step_, " ended without tensor '",
                       job_->tensor_name(job_->shards[s]), "' elements ",
                       Range(job_->shards[s].offset + gap->first, job_->shards[s].offset + gap->second),
                       "; push them or list the tensor in no_grad"));
    }
  }
  if (!sum.finished(rank_)) {
    SHARDOPT_RETURN_IF_ERROR(sum.Finish(*job_->state, rank_, std::move(no_grad)));
    ++job_->round.finished_count;
    job_->changed.SignalAll();
  }

  if (job_->round.finished_count == job_->world_size()) {
    // Every rank is in: the sum is whole, and each shard with a gradient from
    // any rank is the one slot of the running sum.
    if (!sum.Complete()) return absl::InternalError("every rank finished, but the running sum is not whole");
    std::vector<ShardGrads> contributions;
    for (uint32_t s = 0; s < job_->shards.size(); ++s) {
      if (sum.Contributed(s)) contributions.push_back({s, {0}});
    }
    SHARDOPT_ASSIGN_OR_RETURN(auto stats, job_->state->ReduceGrads(contributions));
    job_->round.contributions = std::move(contributions);
    job_->round.sealed = true;
    job_->sealed_step = step_;
    job_->sealed_stats = stats;
    job_->changed.SignalAll();
    return Answer();
  }

  const auto deadline = job_->round.deadline;
  job_->WaitUntil([&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_->mu) {
    return job_->dropped || job_->round.epoch != epoch_ || job_->round.sealed;
  }, deadline);
  SHARDOPT_RETURN_IF_ERROR(job_->CheckNotDropped());
  if (job_->sealed_step == step_ && (job_->round.sealed || job_->step >= step_)) return Answer();
  if (job_->round.epoch == epoch_) {  // our own deadline: end the round for everyone
    const std::string missing = job_->MissingSummary();
    job_->EndRound("its barrier deadline passed");
    return absl::DeadlineExceededError(absl::StrCat("barrier of step ", step_, " timed out after ",
                                                    absl::FormatDuration(job_->barrier_timeout), ": ", missing,
                                                    "; nothing was applied: push step ", step_, " again"));
  }
  return Discarded();
}

}  // namespace shardopt
