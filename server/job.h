// One job's data on this server and the lock that guards it. The step
// protocol's pieces (push_session.h, commit_stream.h, job_snapshot.h) and
// JobStore work on a Job under its lock; nothing here talks to the network.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "kernels/step_scalars.h"
#include "server/interval_set.h"
#include "server/memory_budget.h"
#include "server/wakeups.h"
#include "server/running_sum.h"
#include "server/step_intents.h"
#include "server/tenant_ledger.h"
#include "shardopt/v1/optimizer.pb.h"

namespace shardopt {

// The part of one tensor this server owns.
struct OwnedShard {
  uint32_t tensor;  // index into spec.tensors
  uint64_t offset;  // in the tensor
  uint64_t length;
};

// Where one step's time went on this server, in seconds: what
// `shardopt-bench e2e` reports next to its rooflines.
struct StepPhases {
  double push = 0;     // the round's first chunk to the last rank's push ending
  double reduce = 0;   // of that, folding chunks into the running sum
  double barrier = 0;  // the first rank's push ending to the seal
  double norm = 0;     // the sealed sum's sum of squares and nonfinite check
  double apply = 0;    // AdamW over every piece
  double params = 0;   // the first commit's stream, from its start to its last chunk handed to gRPC
};

// A commit's arguments: what a retry must repeat.
struct CommitArgs {
  double lr = 0;
  float gscale = 0;
  bool skip = false;
  std::vector<double> group_lr;  // empty: lr for every group

  // How every skip is recorded: a skip applies nothing, so its other
  // arguments mean nothing, and ranks that skip a step for different
  // reasons (Decide's nonfinite gradients, a loop's zero_grad) agree.
  static CommitArgs Skip() { return {0.0, 1.0f, true, {}}; }

  double lr_of(uint32_t group) const { return group_lr.empty() ? lr : group_lr[group]; }
  // Bitwise: a retry must carry the very same numbers.
  bool operator==(const CommitArgs& other) const;
  // The first difference from `asked`, these first, every bit of the
  // numbers ("lr: 0.01 -> 0.010000000000000002"); empty when equal.
  std::string FirstDifference(const CommitArgs& asked) const;
};

class Job {
 public:
  // A job of a normalized spec (job_spec.h), with its state allocated on
  // `backend` and no initial values yet. A round's early chunks wait in at
  // most `window_bytes` (running_sum.h). Everything the job holds is
  // charged to `budget` first (memory_budget.h): RESOURCE_EXHAUSTED, with
  // nothing allocated, if it does not fit. And to its maker, `owner`, in
  // `tenants` (tenant_ledger.h): its state and window before anything is
  // allocated, so that a job past the maker's cap takes nothing from other
  // tenants meanwhile, then what memory_use() says once it is.
  static absl::StatusOr<std::shared_ptr<Job>> Create(const v1::CreateJobRequest& spec, Backend* backend,
                                                     uint64_t window_bytes, Wakeups* wakeups, MemoryBudget* budget,
                                                     TenantLedger* tenants, const JobOwner& owner);

  // Fixed at creation, read without the lock.
  const v1::CreateJobRequest spec;
  const absl::Duration barrier_timeout;
  const uint64_t window_bytes;
  std::vector<AdamWHyper> hypers;                           // per group
  absl::flat_hash_map<std::string, uint32_t> tensor_index;  // name -> spec.tensors index
  std::vector<int64_t> shard_of_tensor;                     // -1: not on this server
  std::vector<OwnedShard> shards;
  // This life of the job (CreateJobResponse.incarnation): set once while the
  // job is built, fresh or from its checkpoint, before the store publishes
  // it; read without the lock from then on.
  uint64_t incarnation = 0;

  const std::string& name() const { return spec.job(); }
  uint32_t world_size() const { return spec.world_size(); }
  const std::string& tensor_name(const OwnedShard& s) const { return spec.tensors(s.tensor).name(); }
  bool fp32_params(uint32_t tensor) const { return spec.tensors(tensor).param_dtype() == v1::FP32; }
  // Gradients come in the param's dtype for FP32 params, else in the job's.
  v1::DType grad_dtype(uint32_t tensor) const { return fp32_params(tensor) ? v1::FP32 : spec.grad_dtype(); }

  mutable absl::Mutex mu;
  // Signalled whenever the round, the step or `applying` changes, a snapshot ends, or the job is dropped.
  absl::CondVar changed;

  std::unique_ptr<JobState> state ABSL_PT_GUARDED_BY(mu);
  bool dropped ABSL_GUARDED_BY(mu) = false;
  uint64_t step ABSL_GUARDED_BY(mu) = 0;                 // the last step done
  std::vector<uint64_t> adam_steps ABSL_GUARDED_BY(mu);  // per shard
  std::vector<IntervalSet> init_cover ABSL_GUARDED_BY(mu);
  size_t uninitialized_shards ABSL_GUARDED_BY(mu) = 0;
  // Whether an Init has written any state (master or moments), or a restore
  // has: a job without, at step 0, holds nothing (Untouched).
  bool written ABSL_GUARDED_BY(mu) = false;
  // CreateJobs answered OK (the one that made it, and each attach) and not
  // undone since (JobStore::UndoCreate): the job goes with the last undo,
  // not from under a rank whose attach went through.
  uint64_t attaches ABSL_GUARDED_BY(mu) = 0;
  // Its restore (a restore_step's) set the old run's newer steps aside,
  // which an undo would not put back.
  bool set_aside_steps ABSL_GUARDED_BY(mu) = false;

  // The barrier round of step `step + 1`. A round ends sealed (every rank
  // covered its shards) and then committed, or aborted at its deadline.
  struct Round {
    bool active = false;
    bool sealed = false;
    uint64_t epoch = 0;
    // Steady, so that a step of the wall clock cannot end a round early or late.
    std::chrono::steady_clock::time_point deadline;
    std::unique_ptr<RunningSum> sum;  // every rank's chunks, folded in rank order
    uint32_t finished_count = 0;
    std::vector<uint64_t> sessions;  // [rank]: push streams begun, the latest's number
    std::vector<ShardGrads> contributions;
    std::chrono::steady_clock::time_point started, first_finished;
    StepPhases phases;  // filled as the round goes, and by its commit
    // The budget's charge for the sum's growing bookkeeping (running_sum.h).
    MemoryBudget::Charge tracking;
  };
  Round round ABSL_GUARDED_BY(mu);
  // Gradient bytes the job's push streams hold outside the window: a read
  // in flight (at its expected size) or a chunk the window had no room for
  // (what of it is not yet placed). A push stream reads its next chunk only
  // while these and the window leave room for it under the window's cap,
  // unless its rank is the lowest still pushing (PushSession::MayRead). So
  // what a job's pushes hold stays near the cap whatever the number of
  // ranks, and gRPC's flow control holds the rest back in the senders.
  uint64_t held_bytes ABSL_GUARDED_BY(mu) = 0;
  // The push clock (CreateJobResponse.push_clock), and per rank the trainer
  // that began its last push stream (GradChunk.trainer) and the clock then,
  // and how many of that trainer's push streams of the rank are open (only
  // one trainer's can be: CheckRankTrainer).
  struct RankPusher {
    uint64_t trainer = 0;
    uint64_t push = 0;
    uint64_t open = 0;
    uint64_t contender = 0;  // the last other trainer refused while that one's push was open
  };
  uint64_t push_clock ABSL_GUARDED_BY(mu) = 0;
  std::vector<RankPusher> pushers ABSL_GUARDED_BY(mu);  // [rank]
  // How each rank's latest push of a step says it will commit it.
  StepIntents intents ABSL_GUARDED_BY(mu);
  // The phases of the last step done, and of the step being applied.
  StepPhases last_phases ABSL_GUARDED_BY(mu);
  StepPhases applying_phases ABSL_GUARDED_BY(mu);
  // The stats of the last sealed round, kept past its commit so that a
  // retried push of a committed step gets its answer again.
  uint64_t sealed_step ABSL_GUARDED_BY(mu) = 0;
  GradStats sealed_stats ABSL_GUARDED_BY(mu);

  // Run once, when this job first seals a round (step `step` + 1), before
  // the push is answered; a failure ends the round, and the next seal runs
  // it again (JobStore::CreateJob says why it waits for the seal).
  std::function<absl::Status(const v1::CreateJobRequest& spec, uint64_t step)> before_first_seal ABSL_GUARDED_BY(mu);
  // This server's own parts of torn steps at or after the job's step, as
  // (step, life), newest first (checkpoint::OwnTornParts), read once when
  // the job is made or restored: what CreateJob's answers name as
  // own_part_step, without reading the directory at each attach (under the
  // store's lock). Gone at the first seal, which sets them aside.
  std::vector<std::pair<uint64_t, uint64_t>> own_torn_parts ABSL_GUARDED_BY(mu);

  CommitArgs applied ABSL_GUARDED_BY(mu);        // of step `step`
  bool applying ABSL_GUARDED_BY(mu) = false;     // step + 1 is being applied, piece by piece
  CommitArgs apply_args ABSL_GUARDED_BY(mu);     // of step + 1, while applying
  uint64_t apply_progress ABSL_GUARDED_BY(mu) = 0;  // pieces of step + 1 applied so far
  // Checkpoints streaming the state out (job_snapshot.h) without the lock:
  // while any does, nothing writes the state (StateWritable).
  uint32_t snapshots ABSL_GUARDED_BY(mu) = 0;
  // A checkpoint of the job is being written on this server: the next one
  // waits for it (JobStore::WriteCheckpoint), rather than writing the same
  // part beside it.
  bool checkpointing ABSL_GUARDED_BY(mu) = false;
  // The drain (SIGTERM) has taken the job's step for its checkpoint: from
  // then on no commit starts a step here. Before, one of a sealed round
  // does (JobStore::DrainAndCheckpoint waits for it).
  bool drain_taken ABSL_GUARDED_BY(mu) = false;
  // The step whose part this job put in place on this server, if any (even
  // if its checkpoint then failed): a checkpoint of it again keeps that file
  // (checkpoint::PartWriter::Open), which a peer may have listed.
  std::optional<uint64_t> part_written ABSL_GUARDED_BY(mu);
  // The step and life of the checkpoint parts a restore read this job's
  // state from: a checkpoint of that step is theirs, also under this job's
  // own, new life (a job made again after a drop, or from a restore_step;
  // checkpoint::PartWriter::Open). Unless an initial value has changed the
  // state since (at step 0): then that complete step is not this state, and
  // its checkpoint is refused rather than answered complete.
  struct PartsRead {
    uint64_t step = 0;
    uint64_t life = 0;
    bool changed = false;
  };
  std::optional<PartsRead> restored_from ABSL_GUARDED_BY(mu);
  // Set if an apply failed halfway: the state is no step's state.
  absl::Status failed ABSL_GUARDED_BY(mu);
  // Why the last round ended without a commit, for the pushes it discarded.
  std::string round_end ABSL_GUARDED_BY(mu);

  void StartRound(std::chrono::steady_clock::time_point now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Ends the round, committed or not; `why` is what a push of the discarded
  // round is told (empty for a committed one).
  void EndRound(std::string why = {}) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Ends the round as its deadline passed, saying which ranks it lacked (also
  // returned), so that every push it discards is told the same cause.
  std::string EndRoundAtDeadline() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // How that cause begins, as Describe says it of a round not ended yet.
  static constexpr char kDeadlinePassed[] = "its barrier deadline passed: ";
  // EndRoundAtDeadline for an unsealed round whose deadline has passed;
  // what it returned, if it ended the round.
  std::optional<std::string> ExpireIfLate(std::chrono::steady_clock::time_point now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Charges the most one Offer or Finish of the round's sum can add, before
  // it runs; RESOURCE_EXHAUSTED if that does not fit. FitTracking then gives
  // back what it did not use.
  absl::Status ChargeTracking() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  void FitTracking() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Wakes everything that waits on the job: the CondVar's waiters, and the
  // watchers, each run once on the wakeup thread. Every change of the round,
  // the step, `applying` or `dropped`, and every snapshot's end, calls it.
  void Notify() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Runs `wake` (once, on the wakeup thread) at the next Notify. Registered
  // under the same lock as the check that found nothing to do yet, so no
  // change is missed. A round's deadline is a Notify too: StartRound sets one
  // timer for it, whatever the number of waiters.
  void Watch(std::function<void()> wake) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // A push of `rank` waiting for the window: for room to read its next
  // chunk, or to put one in (PushSession::MayRead, Fold). Woken by Notify,
  // and by NotifyProgress, which wakes only a few of them.
  void WatchProgress(uint32_t rank, std::function<void()> wake) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // The round's sum moved on, or a push let go of what it held: the pushes
  // of the lowest unfinished rank, which never wait for the window, of the
  // ranks that became some block's next (RunningSum::TakeNewlyNext), whose
  // waiting chunk may fold now, and the kProgressWakes lowest-ranked others,
  // for the room let go. Waking every waiting push instead made each of a
  // round's O(W x chunks) changes cost O(W); one that finds no room watches
  // again, and the lowest rank always goes on, so no push waits for good.
  void NotifyProgress() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Waits until no step is half applied, so that what follows sees whole
  // steps; false if `deadline` came first.
  bool AwaitWholeStep(absl::Time deadline = absl::InfiniteFuture()) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Whether the state may be written: once no checkpoint streams it (or the
  // job is dropped). A null `wake` waits for that, and the answer is true.
  // Otherwise the answer comes at once, and on false `wake` runs (once, on
  // the wakeup thread) at the job's next change, to ask again: a gRPC
  // reactor waits so without holding a thread.
  bool StateWritable(const std::function<void()>& wake) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // The same, and also once no checkpoint of the job is being written here
  // at all: initial values may set a checkpoint's files aside
  // (JobStore::TryInit), which one still finishing could complete again.
  bool InitWritable(const std::function<void()>& wake) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

  // Which ranks are missing from the round, and the first range one lacks.
  std::string MissingSummary() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Resolves a tensor name to this server's shard and checks that
  // [offset, offset+count) in tensor coordinates lies in it.
  absl::StatusOr<uint32_t> LocateRange(const std::string& tensor, uint64_t offset, uint64_t count) const;
  absl::Status CheckStepToPush(uint64_t t) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  absl::Status CheckNotDropped() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Whether nothing has happened to the job since this server made or
  // restored it: no step applied, no initial value written, no round begun,
  // and no newer steps set aside by its restore (a restore_step's). Such a
  // job holds nothing its checkpoints (or its absence) did not: its
  // CreateJobs may be undone (JobStore::UndoCreate).
  bool Untouched() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // FAILED_PRECONDITION if a trainer other than `trainer` has begun a push
  // of `rank` since `trainer` attached, when the job had begun
  // `attached_at`, or has a push stream of it open (`trainer` is then noted
  // as the rank's contender, for the message it gets later): two live
  // trainers of one rank. `trainer` 0: not checked.
  absl::Status CheckRankTrainer(uint32_t rank, uint64_t trainer, uint64_t attached_at)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // What the job holds, as Describe reports it and its maker is charged:
  // the backend's state, staging and bookkeeping, the window for early
  // chunks at its cap, and what the job keeps per tensor and per rank.
  MemoryUse memory_use() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // Who made it (JobOwner::name), whose cap it counts against.
  const std::string& owner() const { return owner_charge_.owner(); }
  // Moves the push clock on for a push stream of `rank` begun, by `trainer`
  // (0: not said, not recorded), and counts the stream open until
  // NotePushEnded.
  void NotePush(uint32_t rank, uint64_t trainer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  void NotePushEnded(uint32_t rank, uint64_t trainer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  // A push stream of `rank` by `trainer` was answered OK: a trainer that
  // attached while it was open (or was refused then) stays refused until it
  // attaches again.
  void NotePushAnswered(uint32_t rank, uint64_t trainer) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);

 private:
  Job(const v1::CreateJobRequest& spec, uint64_t window_bytes, Wakeups* wakeups, MemoryBudget* budget);
  void WakeRank(uint32_t rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);  // its progress watchers
  // StateWritable, and with `checkpoints_too` InitWritable.
  bool Unwritten(bool checkpoints_too, const std::function<void()>& wake) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  Wakeups* const wakeups_;
  MemoryBudget* const budget_;
  const std::string tracking_what_;  // what a refused tracking charge names, made once
  MemoryBudget::Charge charge_;  // all the job holds but its rounds' growth
  TenantLedger::Charge owner_charge_;  // memory_use(), for its maker
  uint64_t bookkeeping_bytes_ = 0;   // per tensor and per rank, fixed at creation
  std::weak_ptr<Job> self_;  // for the round's deadline timer, which may outlive the job
  std::vector<std::function<void()>> watchers_ ABSL_GUARDED_BY(mu);
  std::multimap<uint32_t, std::function<void()>> progress_watchers_ ABSL_GUARDED_BY(mu);  // by rank
};

}  // namespace shardopt
