#include "server/push_session.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "rpc/barrier_timeout.h"
#include "rpc/chunk_size.h"
#include "server/job_spec.h"
#include "server/metrics.h"
#include "server/messages.h"

namespace shardopt {
namespace {

double Seconds(std::chrono::steady_clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

absl::StatusOr<std::unique_ptr<PushSession>> PushSession::Begin(std::shared_ptr<Job> job, const v1::GradChunk& first) {
  absl::MutexLock lock(&job->mu);
  if (first.rank() >= job->world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", first.rank(), " is out of range: job '", job->name(),
                                                   "' has world_size ", job->world_size()));
  }
  SHARDOPT_RETURN_IF_ERROR(job->CheckRankTrainer(first.rank(), first.trainer(), first.attached_at()));
  const bool resealed = first.step() == job->step && job->sealed_step == job->step && job->step > 0;
  if (!resealed) {
    SHARDOPT_RETURN_IF_ERROR(job->CheckStepToPush(first.step()));
    // The step done, its sums no longer kept (a later step was sealed, or
    // the job was restored): refused now, not after the whole gradient.
    if (first.step() == job->step) {
      return absl::FailedPreconditionError(absl::StrCat("job '", job->name(), "' is at step ", job->step, "; step ",
                                                        first.step(), " is stale (done, and its answer is no longer "
                                                        "kept); push step ", job->step + 1));
    }
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
  if (const int lrs = first.intent().group_lr_size(); lrs != 0 && lrs != job->spec.groups_size()) {
    return absl::InvalidArgumentError(absl::StrCat("the push's intent has ", lrs, " group lrs; job '", job->name(),
                                                   "' has ", job->spec.groups_size(), " groups"));
  }
  job->intents.Note(first.rank(), first.step(), first.has_intent() ? &first.intent() : nullptr);
  job->NotePush(first.rank(), first.trainer());
  // Held to the window's cap: a size past it would hold the stream back no
  // more (it reads when it is the lowest rank), and MayRead's sum of it
  // with what is held would wrap past 2^64.
  const uint64_t said_chunk = std::min<uint64_t>(first.chunk_bytes(), job->window_bytes);
  return std::unique_ptr<PushSession>(new PushSession(job, first.step(), first.rank(), first.trainer(), said_chunk));
}

PushSession::PushSession(std::shared_ptr<Job> job, uint64_t step, uint32_t rank, uint64_t trainer,
                         uint64_t said_chunk)
    : job_(std::move(job)), step_(step), rank_(rank), trainer_(trainer), said_chunk_(said_chunk) {}

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
  absl::MutexLock lock(&job_->mu);
  job_->NotePushEnded(rank_, trainer_);
  if (Hold(0)) job_->NotifyProgress();
  if (!started_ || answered_) return;
  Job::Round& round = job_->round;
  if (!round.active || round.epoch != epoch_ || round.sealed || round.sum->finished(rank_) ||
      round.sessions[rank_] != session_) {
    return;
  }
  if (round.sum->Withdraw(rank_)) {
    job_->Notify();
    return;
  }
  if (refused_) {
    job_->EndRound(absl::StrCat("rank ", rank_, "'s push was refused after part of it was summed"));
  }
}

absl::StatusOr<bool> PushSession::Offer(v1::GradChunk head, Pieces data, std::vector<GradPart> more,
                                        const Wake& wake) {
  absl::StatusOr<bool> taken = Take(std::move(head), std::move(data), std::move(more), wake);
  refused_ = refused_ || !taken.ok();
  return taken;
}

absl::StatusOr<bool> PushSession::Resume(const Wake& wake) {
  absl::StatusOr<bool> taken = [&]() -> absl::StatusOr<bool> {
    absl::MutexLock lock(&job_->mu);
    return FoldAll(wake);
  }();
  refused_ = refused_ || !taken.ok();
  return taken;
}

absl::StatusOr<bool> PushSession::Take(v1::GradChunk chunk, Pieces data, std::vector<GradPart> more,
                                       const Wake& wake) {
  if ((!chunk.job().empty() && chunk.job() != job_->name()) || (chunk.step() != 0 && chunk.step() != step_) ||
      (chunk.rank() != 0 && chunk.rank() != rank_)) {
    return absl::InvalidArgumentError("job, step and rank must not change within one push stream");
  }
  // Resolved as they arrive, so a stream of names holds one bit per tensor
  // of the job however many it sends, and an unknown one is refused at once.
  // A stream names at most as many as the job has tensors.
  no_grad_names_ += chunk.no_grad_size();
  if (no_grad_names_ > static_cast<uint64_t>(job_->spec.tensors_size())) {
    return absl::InvalidArgumentError(absl::StrCat("the push stream names ", no_grad_names_,
                                                   " no_grad tensors; job '", job_->name(), "' has ",
                                                   job_->spec.tensors_size()));
  }
  for (const std::string& t : chunk.no_grad()) {
    auto it = job_->tensor_index.find(t);  // fixed at creation: no lock needed
    if (it == job_->tensor_index.end()) {
      return absl::NotFoundError(absl::StrCat("no_grad names tensor ", Quote(t), ", which job '", job_->name(), "' lacks"));
    }
    if (no_grad_.empty()) no_grad_.resize(job_->spec.tensors_size());
    no_grad_[it->second] = true;
  }
  uint64_t bytes = data.size();
  for (const GradPart& part : more) bytes += part.data.size();
  largest_chunk_ = std::max(largest_chunk_, bytes);
  absl::MutexLock lock(&job_->mu);
  queued_ = std::move(more);
  next_queued_ = 0;
  message_bytes_ = bytes;
  absl::Status staged = Stage(chunk, std::move(data));
  absl::StatusOr<bool> taken = staged.ok() ? FoldAll(wake) : absl::StatusOr<bool>(staged);
  // The read this message was held for is done; what of it waits for the
  // window is held instead (Fold), and a read started ahead is held still.
  if (!pending_ && Hold(ReadInFlight())) job_->NotifyProgress();
  read_ahead_ = false;
  return taken;
}

absl::Status PushSession::Stage(const v1::GradChunk& chunk, Pieces data) {
  const bool has_data = !chunk.tensor().empty() || !data.empty();
  SHARDOPT_RETURN_IF_ERROR(job_->CheckNotDropped());
  const auto now = std::chrono::steady_clock::now();
  job_->ExpireIfLate(now);
  if (started_ && job_->step < step_ && (job_->round.epoch != epoch_ || !job_->round.active)) return Discarded();
  if (!has_data) return absl::OkStatus();
  SHARDOPT_ASSIGN_OR_RETURN(auto dtype, FromProto(chunk.dtype()));
  SHARDOPT_RETURN_IF_ERROR(CheckDataLength(data.size(), dtype, "gradient chunk"));
  const uint64_t count = data.size() / DTypeSize(dtype);
  SHARDOPT_ASSIGN_OR_RETURN(auto shard, job_->LocateRange(chunk.tensor(), chunk.offset(), count));
  if (const v1::DType want = job_->grad_dtype(job_->shards[shard].tensor); ToProto(dtype) != want) {
    return absl::InvalidArgumentError(absl::StrCat("tensor '", chunk.tensor(), "' of job '", job_->name(), "' takes ",
                                                   v1::DType_Name(want), " gradients; this chunk is ",
                                                   v1::DType_Name(chunk.dtype())));
  }
  // Refused before it counts: folded, it could not be taken back, and the
  // seal's refusal would then end the round for every rank.
  if (const uint32_t t = job_->shards[shard].tensor; t < no_grad_.size() && no_grad_[t]) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank_, " both pushed tensor '", chunk.tensor(),
                                                   "' and declared it no_grad"));
  }
  if (job_->step >= step_) return absl::OkStatus();  // a retry of a committed step: already counted
  if (!started_) Start(now);
  if (job_->round.sealed) return absl::OkStatus();  // a retry after the barrier: already counted
  pending_ = std::move(data);
  pending_offset_ = chunk.offset();
  pending_taken_ = 0;
  pending_dtype_ = dtype;
  pending_shard_ = shard;
  return absl::OkStatus();
}

absl::StatusOr<bool> PushSession::FoldAll(const Wake& wake) {
  for (;;) {
    SHARDOPT_ASSIGN_OR_RETURN(const bool folded, Fold(wake));
    if (!folded) return false;
    if (next_queued_ == queued_.size()) {
      queued_.clear();
      next_queued_ = 0;
      return true;
    }
    GradPart& part = queued_[next_queued_++];
    SHARDOPT_RETURN_IF_ERROR(Stage(part.head, std::move(part.data)));
  }
}

absl::StatusOr<bool> PushSession::Fold(const Wake& wake) {
  if (!pending_) return true;
  SHARDOPT_RETURN_IF_ERROR(job_->CheckNotDropped());
  job_->ExpireIfLate(std::chrono::steady_clock::now());
  if (job_->round.epoch != epoch_) return Discarded();
  const uint64_t esize = DTypeSize(pending_dtype_);
  const uint64_t count = pending_->size() / esize;
  const uint64_t local = pending_offset_ - job_->shards[pending_shard_].offset;
  RunningSum& sum = *job_->round.sum;
  const uint64_t before = sum.progress();
  const auto t0 = std::chrono::steady_clock::now();
  SHARDOPT_RETURN_IF_ERROR(job_->ChargeTracking());
  absl::StatusOr<RunningSum::Offered> taken =
      sum.Offer(*job_->state, rank_, pending_shard_, local + pending_taken_, pending_dtype_,
                pending_->Sub(pending_taken_ * esize, (count - pending_taken_) * esize));
  job_->FitTracking();
  SHARDOPT_ASSIGN_OR_RETURN(auto offered, std::move(taken));
  job_->round.phases.reduce += Seconds(std::chrono::steady_clock::now() - t0);
  pending_taken_ += offered.taken;
  if (!offered.window_full) pending_.reset();
  // Held now: while part of the chunk waits for the window, its message
  // (the chunks packed after it too). One wake for both changes.
  const bool let_go = Hold(ReadInFlight() + (pending_ ? message_bytes_ : 0));
  if (sum.progress() != before || let_go) job_->NotifyProgress();
  if (!pending_) return true;
  // The window is full: this stream is not read until it drains, so gRPC's
  // flow control holds the sender back.
  job_->WatchProgress(rank_, wake);
  return false;
}

bool PushSession::Hold(uint64_t bytes) {
  job_->held_bytes = job_->held_bytes - held_ + bytes;
  const bool let_go = bytes < held_;
  held_ = bytes;
  return let_go;
}

uint64_t PushSession::ExpectedRead() const {
  // The most the stream's first message said its chunks carry, or the
  // largest it has sent, if larger (a client that says less than it sends
  // is counted at what it sends). Not its last chunk: a 140 KB tensor's
  // chunk before 4 MiB ones let 24 ranks' reads hold 63 MB against an 8 MiB
  // cap. Before any chunk of a stream that says nothing (an older client's),
  // the size a client chooses for the job's ranks: that guess, 256 KiB where
  // a client sent 3.2 MB, let 48 ranks' reads hold 154 MB against 64 MiB.
  const uint64_t most = std::max(said_chunk_, largest_chunk_);
  return most > 0 ? most : AutoChunkBytes(job_->world_size());
}

bool PushSession::ReadAhead() {
  absl::MutexLock lock(&job_->mu);
  // Only a counted chunk of the lowest rank: the others may wait for the
  // window, and a wait with a read in flight would hold two chunks.
  read_ahead_ = started_ && !pending_ && job_->step < step_ && job_->round.active && job_->round.epoch == epoch_ &&
                !job_->round.sealed && rank_ == job_->round.sum->lowest_unfinished();
  return read_ahead_;
}

absl::StatusOr<bool> PushSession::MayRead(const Wake& wake) {
  const uint64_t expected = ExpectedRead();
  absl::MutexLock lock(&job_->mu);
  SHARDOPT_RETURN_IF_ERROR(CheckRoundLocked());
  // Chunks that are not summed cost nothing held: a retry of a step already
  // sealed or committed.
  const bool active = job_->round.active;
  const bool counted = job_->step < step_ && !(active && job_->round.sealed);
  // Before the round starts nobody has finished, so rank 0 is the lowest.
  const uint32_t lowest = active ? job_->round.sum->lowest_unfinished() : 0;
  const uint64_t windowed = active ? job_->round.sum->window_bytes() : 0;
  if (!counted || rank_ == lowest || job_->held_bytes - held_ + windowed + expected <= job_->window_bytes) {
    if (Hold(counted ? expected : 0)) job_->NotifyProgress();
    return true;
  }
  job_->WatchProgress(rank_, wake);
  return false;
}

uint64_t PushSession::packed_chunks_allowed() const { return job_->spec.tensors_size(); }  // fixed at creation

uint64_t PushSession::no_grad_names_left() const {
  const uint64_t tensors = job_->spec.tensors_size();  // fixed at creation
  return no_grad_names_ >= tensors ? 0 : tensors - no_grad_names_;
}

std::optional<std::chrono::steady_clock::time_point> PushSession::RoundDeadline() const {
  absl::MutexLock lock(&job_->mu);
  if (!started_) return std::nullopt;
  // Ended already (another rank's wait may have seen the deadline first):
  // passed, so the stream's timer asks CheckRound at once.
  if (job_->round.epoch != epoch_ || !job_->round.active) return std::chrono::steady_clock::time_point::min();
  return job_->round.deadline;
}

absl::Status PushSession::CheckRound() {
  absl::MutexLock lock(&job_->mu);
  return CheckRoundLocked();
}

absl::Status PushSession::CheckRoundLocked() {
  SHARDOPT_RETURN_IF_ERROR(job_->CheckNotDropped());
  job_->ExpireIfLate(std::chrono::steady_clock::now());
  if (started_ && job_->step < step_ && (job_->round.epoch != epoch_ || !job_->round.active)) {
    refused_ = true;
    return Discarded();
  }
  return absl::OkStatus();
}

absl::Status PushSession::Discarded() const {
  // Naming the job: the refused line in the log is all an operator of a
  // server of many jobs sees of it (an outside probe).
  return absl::DeadlineExceededError(absl::StrCat("job ", Quote(job_->name()), ": the round of step ", step_,
                                                  " ended before it was sealed (",
                                                  job_->round_end, "); nothing was applied and rank ", rank_,
                                                  "'s gradients were discarded: push step ", step_, " again"));
}

absl::StatusOr<std::optional<v1::PushResponse>> PushSession::TrySeal(const Wake& wake) {
  absl::StatusOr<std::optional<v1::PushResponse>> answer = [&] {
    absl::MutexLock lock(&job_->mu);
    // The stream's last read found its end: it holds nothing more.
    if (Hold(0)) job_->NotifyProgress();
    auto sealed = sealing_ ? AwaitSeal(wake) : Seal(wake);
    // Counted under the job's lock, which a drop takes to mark the job
    // before it forgets the job's series: a push answered as its job goes
    // does not make them again.
    if (sealed.ok() && *sealed) job_->NotePushAnswered(rank_, trainer_);
    if (sealed.ok() && *sealed && !job_->dropped) {
      metrics::Registry::Default().Increment("shardopt_pushes_total", {{"job", job_->name()}});
    }
    return sealed;
  }();
  if (answer.ok() && *answer) answered_ = true;
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

absl::Status PushSession::EndedWithout(size_t shard, std::pair<uint64_t, uint64_t> gap) const {
  const OwnedShard& s = job_->shards[shard];
  return absl::FailedPreconditionError(absl::StrCat("rank ", rank_, "'s push of step ", step_, " ended without tensor '",
                                                    job_->tensor_name(s), "' elements ",
                                                    Range(s.offset + gap.first, s.offset + gap.second),
                                                    "; push them or list the tensor in no_grad"));
}

absl::StatusOr<std::vector<bool>> PushSession::Declared() const {
  const RunningSum& sum = *job_->round.sum;
  std::vector<bool> no_grad(job_->shards.size(), false);
  for (uint32_t t = 0; t < no_grad_.size(); ++t) {
    if (!no_grad_[t]) continue;
    const int64_t s = job_->shard_of_tensor[t];
    if (s < 0) continue;
    if (sum.FirstGap(rank_, static_cast<uint32_t>(s)) !=
        std::make_optional(std::make_pair(uint64_t{0}, job_->shards[s].length))) {
      return absl::InvalidArgumentError(absl::StrCat("rank ", rank_, " both pushed tensor '", job_->spec.tensors(t).name(),
                                                     "' and declared it no_grad"));
    }
    no_grad[s] = true;
  }
  for (size_t s = 0; s < job_->shards.size(); ++s) {
    if (no_grad[s]) continue;
    if (auto gap = sum.FirstGap(rank_, static_cast<uint32_t>(s))) return EndedWithout(s, *gap);
  }
  return no_grad;
}

absl::StatusOr<std::optional<v1::PushResponse>> PushSession::Seal(const Wake& wake) {
  SHARDOPT_RETURN_IF_ERROR(job_->CheckNotDropped());
  if (pending_) return absl::FailedPreconditionError("the push ended while a chunk was still being taken");
  if (job_->step >= step_) {  // a retry of a committed step: its answer, if still kept
    if (job_->sealed_step == step_) return Answer();
    return absl::FailedPreconditionError(absl::StrCat("step ", step_, " is stale: job '", job_->name(), "' is at step ", job_->step));
  }
  const auto now = std::chrono::steady_clock::now();
  job_->ExpireIfLate(now);
  // A stream that sent no chunk and would start the round has pushed no
  // shard, so it must declare every one no_grad; refused, it must not have
  // started the round (its deadline would count from a refused push).
  if (!started_ && !job_->round.active) {
    for (size_t s = 0; s < job_->shards.size(); ++s) {
      const uint32_t t = job_->shards[s].tensor;
      if (t >= no_grad_.size() || !no_grad_[t]) return EndedWithout(s, {0, job_->shards[s].length});
    }
  }
  // A stream that sent no chunk joins the round only once its declaration
  // holds: refused, it then leaves the round as it found it. Joined, it would
  // be the rank's newest stream, and its refusal would end a round in which
  // an earlier, cut stream of the rank had chunks summed.
  if (!started_ && job_->round.active && !job_->round.sealed) SHARDOPT_RETURN_IF_ERROR(Declared().status());
  if (!started_) Start(now);
  if (job_->round.epoch != epoch_) return Discarded();
  if (job_->round.sealed) return Answer();
  RunningSum& sum = *job_->round.sum;
  SHARDOPT_ASSIGN_OR_RETURN(std::vector<bool> no_grad, Declared());
  if (!sum.finished(rank_)) {
    const auto t0 = std::chrono::steady_clock::now();
    SHARDOPT_RETURN_IF_ERROR(job_->ChargeTracking());
    const absl::Status finished = sum.Finish(*job_->state, rank_, std::move(no_grad));
    job_->FitTracking();
    if (!finished.ok()) {
      // The rank counts as finished, but some blocks may not have moved past
      // it: the round can never be whole. Ended now, its pushes hear it at
      // once instead of at the barrier's deadline.
      job_->EndRound(absl::StrCat("rank ", rank_, "'s finish could not be summed (", finished.message(), ")"));
      return finished;
    }
    const auto t1 = std::chrono::steady_clock::now();
    job_->round.phases.reduce += Seconds(t1 - t0);
    if (job_->round.finished_count == 0) job_->round.first_finished = t1;
    ++job_->round.finished_count;
    // The lowest unfinished rank may now be another; the barrier's waiters
    // are woken when it is sealed, below.
    job_->NotifyProgress();
  }

  if (job_->round.finished_count == job_->world_size()) {
    // Every rank is in: the sum is whole, and each shard with a gradient from
    // any rank is the one slot of the running sum.
    // A seal that fails leaves every rank finished and the round unsealed
    // for good: it is ended now, so the other ranks hear it at once, not at
    // the barrier's deadline, and push the step again.
    if (!sum.Complete()) {
      job_->EndRound("every rank finished, but the running sum is not whole");
      return absl::InternalError("every rank finished, but the running sum is not whole");
    }
    if (job_->before_first_seal) {
      const absl::Status ready = job_->before_first_seal(job_->spec, job_->step);
      if (!ready.ok()) {
        job_->EndRound(absl::StrCat("the round could not be sealed (", ready.message(), ")"));
        return ready;
      }
      job_->before_first_seal = nullptr;
      job_->own_torn_parts.clear();  // set aside
    }
    std::vector<ShardGrads> contributions;
    for (uint32_t s = 0; s < job_->shards.size(); ++s) {
      if (sum.Contributed(s)) contributions.push_back({s, {0}});
    }
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<GradStats> stats = job_->state->ReduceGrads(contributions);
    if (!stats.ok()) {
      job_->EndRound(absl::StrCat("the gradients' norm could not be taken (", stats.status().message(), ")"));
      return stats.status();
    }
    const auto t1 = std::chrono::steady_clock::now();
    StepPhases& phases = job_->round.phases;
    phases.push = Seconds(t0 - job_->round.started);
    phases.barrier = Seconds(t0 - job_->round.first_finished);
    phases.norm = Seconds(t1 - t0);
    job_->round.contributions = std::move(contributions);
    job_->round.sealed = true;
    job_->sealed_step = step_;
    job_->sealed_stats = *std::move(stats);
    job_->Notify();
    return Answer();
  }
  sealing_ = true;
  return AwaitSeal(wake);
}

absl::StatusOr<std::optional<v1::PushResponse>> PushSession::AwaitSeal(const Wake& wake) {
  SHARDOPT_RETURN_IF_ERROR(job_->CheckNotDropped());
  if (job_->sealed_step == step_ && (job_->round.sealed || job_->step >= step_)) return Answer();
  if (job_->round.epoch != epoch_) return Discarded();
  if (std::chrono::steady_clock::now() < job_->round.deadline) {
    job_->Watch(wake);
    return std::nullopt;
  }
  // Our own deadline: end the round for everyone.
  const std::string missing = job_->EndRoundAtDeadline();
  return absl::DeadlineExceededError(absl::StrCat("job ", Quote(job_->name()), ": ", BarrierTimedOut(step_), " after ",
                                                  absl::FormatDuration(job_->barrier_timeout), ": ", missing,
                                                  "; nothing was applied: push step ", step_, " again"));
}

}  // namespace shardopt
