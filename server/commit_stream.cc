#include "server/commit_stream.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "rpc/learning_rates.h"
#include "rpc/push_incomplete.h"
#include "server/metrics.h"

namespace shardopt {
namespace {

absl::StatusOr<CommitArgs> CheckArgs(const Job& job, const v1::CommitRequest& req) {
  // Before anything is checked: an older client's skip carries its lr.
  if (req.skip()) return CommitArgs::Skip();
  SHARDOPT_RETURN_IF_ERROR(CheckLearningRates(req.lr(), absl::MakeConstSpan(req.group_lr().data(), req.group_lr_size()),
                                              job.hypers, job.name()));
  // 1/(loss_scale*world_size) times a clip factor in (0, 1]: a negative one
  // would step up the gradient. (0 is a clip factor's underflow.)
  if (!std::isfinite(req.gscale()) || req.gscale() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("gscale must be finite and >= 0, got ", req.gscale()));
  }
  return CommitArgs{req.lr(), req.gscale(), req.skip(), {req.group_lr().begin(), req.group_lr().end()}};
}

// A piece of one shard: the unit of applying and of streaming.
struct Piece {
  uint32_t shard;
  uint64_t offset;
  uint64_t length;
};

// One commit call's walk through step t's pieces.
class CommitStream {
 public:
  CommitStream(Job& job, uint64_t t, const CommitArgs& args, const CommitOptions& options)
      : job_(job), t_(t), args_(args), options_(options) {
    for (uint32_t si = 0; si < job.shards.size(); ++si) {
      for (uint64_t off = 0; off < job.shards[si].length; off += options.piece_elements) {
        pieces_.push_back({si, off, std::min(options.piece_elements, job.shards[si].length - off)});
      }
    }
  }

  // Checks the step against the job's, and starts applying it if this is
  // the step's first commit. False: a checkpoint streams the state, and
  // `wake` runs when it is time to ask again (Job::StateWritable).
  absl::StatusOr<bool> Open(const std::function<void()>& wake) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_.mu) {
    // A step starts applying only once no checkpoint streams the state.
    if (t_ == job_.step + 1 && !job_.applying && !job_.StateWritable(wake)) return false;
    SHARDOPT_RETURN_IF_ERROR(job_.CheckNotDropped());
    if (!job_.failed.ok()) return job_.failed;
    if (t_ > job_.step + 1) {
      return absl::OutOfRangeError(absl::StrCat("job '", job_.name(), "' is at step ", job_.step, "; commit of step ",
                                                t_, " is in the future"));
    }
    if (t_ == 0 || t_ < job_.step) {
      return absl::FailedPreconditionError(absl::StrCat("job '", job_.name(), "' is at step ", job_.step,
                                                        "; commit of step ", t_, " is stale",
                                                        t_ == 0 ? "" : " (it was applied, and the job has gone on "
                                                                       "since: another trainer of this rank?)",
                                                        "; Read PARAM_BF16 for the current params"));
    }
    if (t_ == job_.step + 1 && !job_.applying) {
      // Draining: only a sealed round's commit, until the drain takes the
      // step (JobStore::DrainAndCheckpoint).
      if (options_.draining && (job_.drain_taken || !job_.round.active || !job_.round.sealed)) {
        return absl::UnavailableError(absl::StrCat("the server is shutting down (SIGTERM) and checkpointing job '",
                                                   job_.name(), "' at step ", job_.step, "; push and commit step ", t_,
                                                   " again on the restarted server (the checkpoint holds no pushed "
                                                   "gradients)"));
      }
      // A round whose deadline this commit is the first to see is ended
      // here, and named as its pushes are told.
      const std::optional<std::string> ended = job_.ExpireIfLate(std::chrono::steady_clock::now());
      if (!job_.round.sealed) {
        return absl::FailedPreconditionError(absl::StrCat(
            PushIncomplete(t_), ": ", ended ? absl::StrCat("the round ended, ", *ended) : job_.MissingSummary()));
      }
      if (!args_.skip) {
        if (std::string differ = job_.intents.Disagreement(t_); !differ.empty()) {
          return absl::FailedPreconditionError(absl::StrCat(
              "the ranks of job '", job_.name(), "' pushed step ", t_, " to be applied differently (", differ,
              "); nothing was applied: every rank must step with the same lr, group "
              "lrs, max_grad_norm and loss_scale (RemoteAdamW's is always 1); a rank that pushes the step again "
              "says its settings anew"));
        }
        // Decide skips such a step; a client that applies it anyway would
        // make this server's masters NaN for good.
        if (job_.sealed_stats.nonfinite) {
          return absl::FailedPreconditionError(absl::StrCat(
              "the summed gradient of step ", t_, " of job '", job_.name(),
              "' is not finite on this server (its pushes were answered nonfinite), so every server's answers "
              "decide a skip; nothing was applied here: every rank commits the step with skip on every server "
              "(a server that applied it already holds another step than the others: restore the job from a "
              "checkpoint)"));
        }
      }
      job_.applying = true;
      job_.apply_args = args_;
      job_.apply_progress = 0;
      starts_apply_ = true;
    } else {
      const CommitArgs& a = t_ == job_.step ? job_.applied : job_.apply_args;
      if (!(a == args_)) {
        return absl::AbortedError(absl::StrCat("step ", t_, t_ == job_.step ? " was " : " is being ",
                                               a.skip ? "skipped" : "applied",
                                               " with other arguments than this commit's (",
                                               a.FirstDifference(args_),
                                               "): ranks disagree, or a retry changed them; a step is applied once, "
                                               "and a retry must carry the very same numbers"));
      }
    }
    // The step's per-shard scalars, needed only by a commit that may apply.
    contribution_.assign(job_.shards.size(), -1);
    if (t_ == job_.step + 1 && !args_.skip) {
      for (const ShardGrads& sg : job_.round.contributions) {
        const uint32_t group = job_.spec.tensors(job_.shards[sg.shard].tensor).group();
        contribution_[sg.shard] = static_cast<int64_t>(scalars_.size());
        scalars_.push_back(ComputeAdamWScalars(job_.hypers[group], args_.lr_of(group), args_.gscale,
                                               job_.adam_steps[sg.shard] + 1));
      }
    }
    return true;
  }

  size_t pieces() const { return pieces_.size(); }
  // Once the last piece is out: if this stream's Open began applying the
  // step, its stream is the step's, and the step's phases are recorded.
  void RecordPhases(std::chrono::steady_clock::time_point started) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_.mu) {
    if (!starts_apply_) return;
    job_.last_phases = job_.applying_phases;
    job_.last_phases.params = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    starts_apply_ = false;
    // A drop marks the job under this lock before it forgets the job's
    // series: a commit ending as its job goes does not make them again.
    if (job_.dropped) return;
    metrics::Registry& m = metrics::Registry::Default();
    const metrics::Labels job = {{"job", job_.name()}};
    m.Increment("shardopt_commits_total", job);
    if (args_.skip) m.Increment("shardopt_skipped_steps_total", job);
    m.Observe("shardopt_push_wait_seconds", job, job_.last_phases.barrier);
    m.Observe("shardopt_apply_seconds", job, job_.last_phases.apply);
    m.Observe("shardopt_params_stream_seconds", job, job_.last_phases.params);
  }
  absl::Mutex& mu() const ABSL_LOCK_RETURNED(job_.mu) { return job_.mu; }

  // Applies piece k if it is the next one to apply, then holds its params.
  // ABORTED when the next step has overtaken it.
  absl::StatusOr<ParamStream::Piece> Read(uint64_t k) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_.mu) {
    SHARDOPT_RETURN_IF_ERROR(job_.CheckNotDropped());
    if (!job_.failed.ok()) return job_.failed;
    if (ApplyingStep() && job_.apply_progress == k) {
      SHARDOPT_RETURN_IF_ERROR(ApplyNext());
    }
    // Piece k holds step t once t is done and the next step has not yet
    // been applied past it, or while t is being applied and is past it.
    const bool applied_past_k = job_.applying && job_.apply_progress > k;
    const bool holds_t = job_.step == t_ ? !applied_past_k : ApplyingStep() && applied_past_k;
    if (!holds_t) return absl::AbortedError(absl::StrCat("step ", t_, " was superseded while streaming its params"));
    const Piece& p = pieces_[k];
    const uint32_t tensor = job_.shards[p.shard].tensor;
    // FP32 params are the master itself; bf16 ones its rounding.
    const bool fp32 = job_.fp32_params(tensor);
    absl::StatusOr<Pieces> held = job_.state->HoldState(
        p.shard, fp32 ? StateKind::kMaster : StateKind::kParamBf16, p.offset, p.length, fp32 ? DType::kFp32 : DType::kBf16);
    if (!held.ok()) {
      SHARDOPT_RETURN_IF_ERROR(Finish());
      return held.status();
    }
    return ParamStream::Piece{t_, &job_.spec.tensors(tensor).name(), job_.shards[p.shard].offset + p.offset, fp32,
                              *std::move(held)};
  }

  // Applies what is left of step t, for a commit whose caller went away.
  absl::Status Finish() ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_.mu) {
    while (ApplyingStep()) {
      SHARDOPT_RETURN_IF_ERROR(ApplyNext());
    }
    return absl::OkStatus();
  }

 private:
  bool ApplyingStep() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_.mu) {
    return job_.step + 1 == t_ && job_.applying;
  }

  // Applies the next piece of step t; the last one completes the step in the
  // same critical section, so no rank ever sees the job's step between two
  // pieces.
  absl::Status ApplyNext() ABSL_EXCLUSIVE_LOCKS_REQUIRED(job_.mu) {
    const uint64_t k = job_.apply_progress;
    const Piece& p = pieces_[k];
    if (const int64_t c = contribution_[p.shard]; c >= 0) {
      ShardStep step{job_.round.contributions[c], scalars_[c], p.offset, p.length};
      const auto t0 = std::chrono::steady_clock::now();
      const absl::Status st = job_.state->Apply({&step, 1});
      job_.round.phases.apply += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (!st.ok()) {
        // Part of the step is applied: the job's state is no step's state.
        job_.failed = absl::Status(st.code(), absl::StrCat("job '", job_.name(), "' failed while applying step ", t_,
                                                           ": ", st.message()));
        job_.applying = false;
        job_.Notify();
        return job_.failed;
      }
    }
    job_.apply_progress = k + 1;
    if (k + 1 == pieces_.size()) {
      for (size_t s = 0; s < contribution_.size(); ++s) {
        if (contribution_[s] >= 0) ++job_.adam_steps[s];
      }
      job_.step = t_;
      job_.applied = job_.apply_args;
      job_.applying = false;
      job_.applying_phases = job_.round.phases;
      job_.EndRound();
    }
    job_.Notify();
    return absl::OkStatus();
  }

  Job& job_;
  const uint64_t t_;
  const CommitArgs args_;
  const CommitOptions options_;
  std::vector<Piece> pieces_;
  std::vector<int64_t> contribution_;  // [shard]: index into scalars_ and round.contributions, or -1
  std::vector<math::AdamWScalars> scalars_;
  bool starts_apply_ = false;
};

}  // namespace

struct ParamStream::Walk {
  Walk(std::shared_ptr<Job> j, uint64_t t, const CommitArgs& args, const CommitOptions& options)
      : job(std::move(j)), stream(*job, t, args, options) {}
  std::shared_ptr<Job> job;
  CommitStream stream;
};

absl::StatusOr<std::unique_ptr<ParamStream>> ParamStream::Open(std::shared_ptr<Job> job,
                                                               const v1::CommitRequest& request,
                                                               const CommitOptions& options,
                                                               const std::function<void()>& wake) {
  SHARDOPT_ASSIGN_OR_RETURN(auto args, CheckArgs(*job, request));
  std::unique_ptr<ParamStream> out(new ParamStream());
  out->walk_ = std::make_unique<Walk>(std::move(job), request.step(), args, options);
  {
    absl::MutexLock lock(&out->walk_->stream.mu());
    const absl::StatusOr<bool> opened = out->walk_->stream.Open(wake);
    if (!opened.ok() || !*opened) {
      // Not opened, so nothing to abandon: a step being applied is its
      // opener's to finish, and this stream has none of its scalars.
      out->next_ = out->walk_->stream.pieces();
      if (!opened.ok()) return opened.status();
      return nullptr;
    }
  }
  out->started_ = std::chrono::steady_clock::now();
  return out;
}

ParamStream::~ParamStream() {
  if (walk_ && next_ < walk_->stream.pieces()) Abandon().IgnoreError();
}

absl::StatusOr<std::optional<ParamStream::Piece>> ParamStream::Next() {
  absl::MutexLock lock(&walk_->stream.mu());
  if (next_ == walk_->stream.pieces()) {
    walk_->stream.RecordPhases(started_);
    return std::nullopt;
  }
  // Never a piece again after an error: the stream is over.
  absl::StatusOr<Piece> piece = walk_->stream.Read(next_);
  next_ = piece.ok() ? next_ + 1 : walk_->stream.pieces();
  if (!piece.ok()) return piece.status();
  return *piece;
}

absl::Status ParamStream::Abandon() {
  next_ = walk_->stream.pieces();
  absl::MutexLock lock(&walk_->stream.mu());
  SHARDOPT_RETURN_IF_ERROR(walk_->stream.Finish());
  // The step is applied even so, and counted as any other.
  walk_->stream.RecordPhases(started_);
  return absl::OkStatus();
}

absl::Status CommitAndStream(std::shared_ptr<Job> job, const v1::CommitRequest& req, const CommitOptions& options,
                             const std::function<bool(const v1::ParamChunk&)>& emit) {
  SHARDOPT_ASSIGN_OR_RETURN(auto stream, ParamStream::Open(std::move(job), req, options, nullptr));
  v1::ParamChunk chunk;
  for (;;) {
    SHARDOPT_ASSIGN_OR_RETURN(auto piece, stream->Next());
    if (!piece) return absl::OkStatus();
    chunk.set_step(piece->step);
    chunk.set_tensor(*piece->tensor);
    chunk.set_offset(piece->offset);
    if (piece->fp32) {
      chunk.set_dtype(v1::FP32);
    } else {
      chunk.clear_dtype();  // BF16, as servers sent it before param_dtype existed
    }
    chunk.mutable_data()->resize(piece->data.size());
    piece->data.CopyTo(chunk.mutable_data()->data());
    if (!emit(chunk)) {
      SHARDOPT_RETURN_IF_ERROR(stream->Abandon());
      return absl::CancelledError("the caller stopped reading the params");
    }
  }
}

}  // namespace shardopt
