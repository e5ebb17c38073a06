#include "server/job.h"

#include <malloc.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "base/same_bits.h"
#include "base/shortest_number.h"
#include "base/status_macros.h"
#include "rpc/skip_disagreement.h"
#include "server/job_spec.h"
#include "server/messages.h"

namespace shardopt {

bool CommitArgs::operator==(const CommitArgs& o) const {
  if (!SameBits(lr, o.lr) || !SameBits(gscale, o.gscale) || skip != o.skip) return false;
  return std::equal(group_lr.begin(), group_lr.end(), o.group_lr.begin(), o.group_lr.end(), SameBits<double>);
}

std::string CommitArgs::FirstDifference(const CommitArgs& asked) const {
  if (skip != asked.skip) return skip ? kSkippedAskedApplied : kAppliedAskedSkipped;
  if (!SameBits(lr, asked.lr)) return absl::StrCat("lr: ", ShortestNumber(lr), " -> ", ShortestNumber(asked.lr));
  if (!SameBits(gscale, asked.gscale)) {
    return absl::StrCat("gscale: ", ShortestNumber(gscale), " -> ", ShortestNumber(asked.gscale));
  }
  if (group_lr.size() != asked.group_lr.size()) {
    return absl::StrCat("number of group lrs: ", group_lr.size(), " -> ", asked.group_lr.size());
  }
  for (size_t g = 0; g < group_lr.size(); ++g) {
    if (!SameBits(group_lr[g], asked.group_lr[g])) {
      return absl::StrCat("group ", g, "'s lr: ", ShortestNumber(group_lr[g]), " -> ",
                          ShortestNumber(asked.group_lr[g]));
    }
  }
  return "";
}

Job::Job(const v1::CreateJobRequest& s, uint64_t window, Wakeups* wakeups, MemoryBudget* budget)
    : spec(s), barrier_timeout(absl::Milliseconds(s.barrier_timeout_ms())), window_bytes(window), wakeups_(wakeups),
      budget_(budget), tracking_what_(absl::StrCat("the barrier tracking of job ", Quote(s.job()))) {}

namespace {

// The push clock's floor: nanoseconds since the Unix epoch (0 before it).
uint64_t WallClockNanos() { return static_cast<uint64_t>(std::max<int64_t>(0, absl::ToUnixNanos(absl::Now()))); }

// The job's bookkeeping besides its state: per tensor its spec, name index
// and shard entry, per group its spec and hyperparameters, and per rank the
// round's session numbers and its last pusher; a generous bound, allocator
// overhead included.
uint64_t BookkeepingBytes(const v1::CreateJobRequest& spec) {
  // An intent (GradChunk.intent) is a few numbers and a group's lr each.
  const uint64_t intent = 128 + 8 * uint64_t(spec.groups_size());
  uint64_t bytes = 4096 + uint64_t{spec.world_size()} * (sizeof(uint64_t) + sizeof(Job::RankPusher) + intent);
  // Per tensor, measured: a job of 128,000 one-element tensors grew the
  // server by 1.6 KiB a tensor with 7-byte names and 2.6 KiB with 190-byte
  // ones (the name is kept in the spec, its shard and the index, each a
  // heap block of its own), of which state and staging were 0.6 KiB.
  for (const v1::TensorSpec& t : spec.tensors()) bytes += 1024 + 6 * t.name().size() + 8 * uint64_t(t.shape_size());
  for (const v1::Group& g : spec.groups()) bytes += 256 + 2 * g.name().size();
  return bytes;
}

}  // namespace

absl::StatusOr<std::shared_ptr<Job>> Job::Create(const v1::CreateJobRequest& spec, Backend* backend,
                                                 uint64_t window_bytes, Wakeups* wakeups, MemoryBudget* budget,
                                                 TenantLedger* tenants, const JobOwner& owner) {
  // Once a job is gone, the heap it freed goes back to the system: a job of
  // many small tensors is thousands of small blocks, which the allocator
  // kept, so that jobs made after drops (or restored) grew the server past
  // its budget (an outside probe: 1.39-1.55 times --memory_limit, the
  // budget's own charge never over it).
  std::shared_ptr<Job> job(new Job(spec, window_bytes, wakeups, budget), [](Job* gone) {
    delete gone;
    malloc_trim(0);
  });
  job->self_ = job;
  for (const v1::Group& g : spec.groups()) {
    job->hypers.push_back({g.beta1(), g.beta2(), g.eps(), g.weight_decay(), g.lr_multiplier()});
  }
  job->shard_of_tensor.assign(spec.tensors_size(), -1);
  for (int i = 0; i < spec.tensors_size(); ++i) job->tensor_index[spec.tensors(i).name()] = i;
  // One fp32 slot, the running sum of every rank's gradient (running_sum.h),
  // whatever the world size and the gradients' dtypes.
  JobLayout layout;
  layout.world_size = 1;
  layout.grad_dtype = DType::kFp32;
  for (const v1::ShardRange& s : spec.shards()) {
    const uint32_t t = job->tensor_index[s.tensor()];
    job->shard_of_tensor[t] = static_cast<int64_t>(job->shards.size());
    job->shards.push_back({t, s.offset(), s.length()});
    const bool bf16 = spec.groups(spec.tensors(t).group()).precision() == v1::PRECISION_BF16;
    layout.shards.push_back({s.length(), bf16 ? Precision::kBf16 : Precision::kFp32});
  }
  std::vector<uint64_t> lengths;
  for (const OwnedShard& s : job->shards) lengths.push_back(s.length);
  job->bookkeeping_bytes_ = RunningSum::FixedBytes(lengths, spec.world_size()) + BookkeepingBytes(spec);
  const uint64_t bytes = backend->HostBytes(layout) + window_bytes + job->bookkeeping_bytes_;
  const std::string what = absl::StrCat("job ", Quote(spec.job()));
  // The maker's cap counts the bookkeeping too: a job of many small tensors
  // is mostly bookkeeping, and a capped tenant's such jobs filled 85% of a
  // budget while its cap saw a third of its own (an outside probe).
  SHARDOPT_RETURN_IF_ERROR(tenants
                               ->Reserve(owner, StateBytes(layout) + window_bytes + job->bookkeeping_bytes_,
                                         absl::StrCat(what, " needs at least"))
                               .status());
  SHARDOPT_ASSIGN_OR_RETURN(job->charge_, budget->ReserveForJob(bytes, what));
  SHARDOPT_ASSIGN_OR_RETURN(auto state, backend->Allocate(layout));
  absl::MutexLock lock(&job->mu);
  job->state = std::move(state);
  // Once allocated, as Describe will say, whatever the backend (the budget,
  // or the device, bounded the allocation already).
  const MemoryUse use = job->memory_use();
  SHARDOPT_ASSIGN_OR_RETURN(job->owner_charge_,
                            tenants->Reserve(owner, use.state_bytes + use.staging_bytes + use.bookkeeping_bytes,
                                             absl::StrCat(what, " needs")));
  job->adam_steps.assign(job->shards.size(), 0);
  job->pushers.resize(spec.world_size());
  job->intents = StepIntents(spec.world_size());
  job->push_clock = WallClockNanos();
  job->init_cover.resize(job->shards.size());
  job->uninitialized_shards = job->shards.size();
  return job;
}

MemoryUse Job::memory_use() const {
  MemoryUse use = state->memory_use();
  use.staging_bytes += window_bytes;
  use.bookkeeping_bytes += bookkeeping_bytes_;
  return use;
}

void Job::StartRound(std::chrono::steady_clock::time_point now) {
  round.active = true;
  round.started = now;
  round.deadline = now + absl::ToChronoNanoseconds(barrier_timeout);
  std::vector<uint64_t> lengths;
  for (const OwnedShard& s : shards) lengths.push_back(s.length);
  round.sum = std::make_unique<RunningSum>(std::move(lengths), world_size(), window_bytes);
  round.sessions.assign(world_size(), 0);
  round.tracking = budget_->Empty();
  // At the deadline every waiter looks again; the first to see it passed
  // ends the round (push_session.cc), saying who is missing.
  wakeups_->At(round.deadline, [weak = self_, epoch = round.epoch] {
    if (auto job = weak.lock()) {
      absl::MutexLock lock(&job->mu);
      if (job->round.epoch == epoch && job->round.active && !job->round.sealed) job->Notify();
    }
  });
}

void Job::EndRound(std::string why) {
  round_end = std::move(why);
  const uint64_t epoch = round.epoch + 1;
  round = Round{};
  round.epoch = epoch;
  Notify();
}

std::optional<std::string> Job::ExpireIfLate(std::chrono::steady_clock::time_point now) {
  if (round.active && !round.sealed && now >= round.deadline) return EndRoundAtDeadline();
  return std::nullopt;
}

std::string Job::EndRoundAtDeadline() {
  std::string missing = MissingSummary();
  EndRound(absl::StrCat(kDeadlinePassed, missing));
  return missing;
}

absl::Status Job::ChargeTracking() {
  return round.tracking.Grow(round.sum->MaxGrowth(), tracking_what_);
}

void Job::FitTracking() {
  const uint64_t used = round.sum->growing_bytes();
  if (round.tracking.bytes() > used) round.tracking.Shrink(round.tracking.bytes() - used);
}

void Job::Notify() {
  changed.SignalAll();
  for (auto& wake : watchers_) wakeups_->Post(std::move(wake));
  watchers_.clear();
  for (auto& [rank, wake] : progress_watchers_) wakeups_->Post(std::move(wake));
  progress_watchers_.clear();
}

void Job::Watch(std::function<void()> wake) { watchers_.push_back(std::move(wake)); }

void Job::WatchProgress(uint32_t rank, std::function<void()> wake) {
  progress_watchers_.emplace(rank, std::move(wake));
}

void Job::NotifyProgress() {
  // About what one fold or one let-go frees: a chunk's room or so.
  constexpr int kProgressWakes = 2;
  uint32_t lowest = 0;
  if (round.active) {
    lowest = round.sum->lowest_unfinished();
    round.sum->DrainNewlyNext([this](uint32_t rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { WakeRank(rank); });
  }
  WakeRank(lowest);
  // Then in rank order: the streams of finished ranks (a retry, or one
  // already cut), which need no room and do not take the others' places,
  // and kProgressWakes more.
  for (int others = 0; !progress_watchers_.empty() &&
                       (progress_watchers_.begin()->first < lowest || others++ < kProgressWakes);) {
    wakeups_->Post(std::move(progress_watchers_.begin()->second));
    progress_watchers_.erase(progress_watchers_.begin());
  }
}

void Job::WakeRank(uint32_t rank) {
  auto [first, last] = progress_watchers_.equal_range(rank);
  for (auto it = first; it != last; ++it) wakeups_->Post(std::move(it->second));
  progress_watchers_.erase(first, last);
}

bool Job::AwaitWholeStep(absl::Time deadline) {
  while (applying && !dropped) {
    if (changed.WaitWithDeadline(&mu, deadline) && applying && !dropped) return false;
  }
  return true;
}

bool Job::StateWritable(const std::function<void()>& wake) { return Unwritten(/*checkpoints_too=*/false, wake); }

bool Job::InitWritable(const std::function<void()>& wake) { return Unwritten(/*checkpoints_too=*/true, wake); }

bool Job::Unwritten(bool checkpoints_too, const std::function<void()>& wake) {
  const auto busy = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return !dropped && (snapshots > 0 || (checkpoints_too && checkpointing));
  };
  if (!wake) {
    while (busy()) changed.Wait(&mu);
    return true;
  }
  if (!busy()) return true;
  Watch(wake);
  return false;
}

std::string Job::MissingSummary() const {
  if (!round.active) return absl::StrCat("no rank has pushed step ", step + 1);
  // At most this many named: at 65536 ranks the whole list would be larger
  // than a message may be.
  constexpr size_t kNamed = 16;
  std::vector<uint32_t> missing;
  size_t more = 0;
  for (uint32_t r = 0; r < world_size(); ++r) {
    if (round.sum->finished(r)) continue;
    if (missing.size() < kNamed) {
      missing.push_back(r);
    } else {
      ++more;
    }
  }
  std::string out = absl::StrCat("ranks {", absl::StrJoin(missing, ", "),
                                 more > 0 ? absl::StrCat(", and ", more, " more") : "", "} of ", world_size(),
                                 " have not finished pushing step ", step + 1);
  if (missing.empty()) return out;
  const uint32_t r = missing.front();
  for (size_t s = 0; s < shards.size(); ++s) {
    if (auto gap = round.sum->FirstGap(r, static_cast<uint32_t>(s))) {
      absl::StrAppend(&out, "; rank ", r, " lacks tensor '", tensor_name(shards[s]), "' elements ",
                      Range(shards[s].offset + gap->first, shards[s].offset + gap->second));
      break;
    }
  }
  return out;
}

absl::StatusOr<uint32_t> Job::LocateRange(const std::string& tensor, uint64_t offset, uint64_t count) const {
  auto it = tensor_index.find(tensor);
  if (it == tensor_index.end()) {
    return absl::NotFoundError(absl::StrCat("job '", name(), "' has no tensor ", Quote(tensor)));
  }
  const int64_t si = shard_of_tensor[it->second];
  const uint64_t numel = spec.tensors(it->second).numel();
  if (offset > numel || count > numel - offset) {
    // offset + count may not fit 64 bits: say the count rather than a wrapped end.
    return absl::OutOfRangeError(absl::StrCat(
        "tensor ", Quote(tensor), " has ", numel, " elements; ",
        // No count (a Read to the shard's end) goes nowhere: the offset is past it.
        count == 0 ? absl::StrCat("offset ", offset, " is past its end")
                   : absl::StrCat(count, " from offset ", offset, " go past its end")));
  }
  if (si < 0) {
    return absl::OutOfRangeError(absl::StrCat("tensor '", tensor, "' has no shard on this server"));
  }
  const OwnedShard& s = shards[si];
  if (offset < s.offset || offset + count > s.offset + s.length) {
    return absl::OutOfRangeError(absl::StrCat("range ", Range(offset, offset + count), " of tensor '", tensor,
                                              "' is outside this server's shard ", Range(s.offset, s.offset + s.length)));
  }
  return static_cast<uint32_t>(si);
}

absl::Status Job::CheckStepToPush(uint64_t t) const {
  if (t == 0 || t < step) {  // not t + 1 <= step, which wraps for the largest t
    return absl::FailedPreconditionError(absl::StrCat("job '", name(), "' is at step ", step, "; step ", t,
                                                      " is stale; push step ", step + 1));
  }
  if (t > step + 1) {
    return absl::OutOfRangeError(absl::StrCat("job '", name(), "' is at step ", step, "; step ", t,
                                              " is in the future; push step ", step + 1));
  }
  return absl::OkStatus();
}

absl::Status Job::CheckRankTrainer(uint32_t rank, uint64_t trainer, uint64_t attached_at) {
  RankPusher& last = pushers[rank];
  if (trainer == 0 || last.trainer == 0 || last.trainer == trainer) return absl::OkStatus();
  const std::string twins = absl::StrCat("two live trainers with rank ", rank, "? Each trainer needs its own rank ",
                                         "(and world_size the number of trainers): stop them, and start each with ",
                                         "its own.");
  if (last.open > 0) {
    // Its stream is open: that trainer lives (a dead one's connection
    // closes), or hangs. Taken for a replacement, this trainer's push
    // would be answered as a retry of that one's, its own gradients
    // dropped and its step reported done (an outside probe's twin, attached
    // while the first waited at the barrier).
    last.contender = trainer;
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, " of job '", name(), "' has a push stream open by another trainer: ", twins,
        " (A trainer started in place of one that hangs is refused until that one's push ends: at its round's ",
        "barrier deadline, or when its stream has sent nothing for --idle_stream_timeout_ms.)"));
  }
  if (last.push <= attached_at) return absl::OkStatus();
  if (trainer == last.contender) {
    return absl::FailedPreconditionError(absl::StrCat(
        "rank ", rank, " of job '", name(), "' had a push stream open by another trainer when this one pushed, and ",
        "that push was answered since: that trainer lives, or did then. ", twins, " (If it hangs, attach again, ",
        "CreateOrAttach or a new RemoteAdamW, to take its place: its push stands, and is this trainer's to commit.)"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "rank ", rank, " of job '", name(), "' has been pushed by another trainer since this one attached: ", twins,
      " (A trainer started in place of this one has taken its rank over.)"));
}

void Job::NotePush(uint32_t rank, uint64_t trainer) {
  // Never behind the wall clock: a server restarted (its jobs restored)
  // starts past what a trainer learnt from the process before.
  push_clock = std::max(push_clock + 1, WallClockNanos());
  if (trainer == 0) return;
  RankPusher& last = pushers[rank];
  if (last.trainer != trainer) last.contender = 0;
  last.open = last.trainer == trainer ? last.open + 1 : 1;  // no other's is open (CheckRankTrainer)
  last.trainer = trainer;
  last.push = push_clock;
}

void Job::NotePushAnswered(uint32_t rank, uint64_t trainer) {
  RankPusher& last = pushers[rank];
  if (trainer == 0 || last.trainer != trainer) return;
  // The answer shows this trainer lived while its push was open: a trainer
  // that attached meanwhile (and, refused, pushed: the contender) stays
  // refused, as if this one had pushed again, until it attaches again.
  // Else its next push, once this one had ended, was taken for a
  // replacement's: answered as a retry of this one, its gradients dropped,
  // and this trainer refused from then on (outside probes). A trainer that
  // attaches after the answer is a replacement, as a killed one's must be.
  push_clock = std::max(push_clock + 1, WallClockNanos());
  last.push = push_clock;
}

void Job::NotePushEnded(uint32_t rank, uint64_t trainer) {
  if (RankPusher& last = pushers[rank]; trainer != 0 && last.trainer == trainer && last.open > 0) --last.open;
}

absl::Status Job::CheckNotDropped() const {
  if (dropped) return absl::NotFoundError(absl::StrCat("job '", name(), "' was dropped"));
  return absl::OkStatus();
}

bool Job::Untouched() const {
  if (round.active || applying || set_aside_steps) return false;
  // A restore writes the state too: what counts is a change since.
  if (restored_from) return step == restored_from->step && !restored_from->changed;
  return step == 0 && !written;
}

}  // namespace shardopt
