// The optimizer's core: the jobs this server holds and the exactly-once step
// protocol of docs/design.md. No network here: the gRPC service is a thin
// adapter over this class, and tests drive it directly.
//
// Thread-safe: every method may be called from any thread at once. Each job
// has its own lock (server/job.h); the store's lock guards only the map of
// jobs, so one job's work never waits on another's.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kernels/backend.h"
#include "rpc/chunk_size.h"
#include "server/checkpoint_buffers.h"
#include "server/commit_stream.h"
#include "server/job.h"
#include "server/job_spec.h"
#include "server/log.h"
#include "server/memory_budget.h"
#include "server/push_session.h"
#include "shardopt/v1/optimizer.pb.h"

namespace shardopt {

struct JobStoreOptions {
  // The server's memory budget in bytes (memory_budget.h); 0: the default,
  // the smaller of physical memory and the cgroup limit, less headroom.
  uint64_t memory_limit = 0;
  absl::Duration default_barrier_timeout = absl::Seconds(60);
  // Elements per streamed ParamChunk / StateChunk: 1 MiB of bf16. Lowered so
  // that a piece of FP32 params fills at most half of `max_message_bytes`,
  // rounded down to a multiple of kApplyAlignment, and at least that.
  uint64_t stream_chunk_elements = 512 * 1024;
  // The largest message the server takes and sends (--max_message_bytes), at
  // least JobStore::kMinMessageBytes: the gRPC server's limit, told to
  // clients in CreateJobResponse.
  uint64_t max_message_bytes = kDefaultMaxMessageBytes;
  // The most bytes of early gradient chunks a job's round holds
  // (server/running_sum.h); a job of W ranks holds at most W x 4 MiB of it.
  uint64_t window_bytes = uint64_t{64} << 20;
  // Caps on what one CreateJob may ask for: each tensor and each rank costs
  // the server bookkeeping, and Describe answers with every tensor.
  uint32_t max_tensors_per_job = 16384;
  uint32_t max_world_size = kMaxWorldSize;
  // The longest job, group or tensor name taken, at most kMaxNameBytes:
  // names are kept per tensor and come back in every Describe.
  uint32_t max_name_bytes = kMaxNameBytes;
  // Where checkpoints go and come from (checkpoint/format.h); empty: none.
  std::string checkpoint_dir;
  // Its identity (checkpoint::DirectoryId), for Describe, and the device it
  // was on at start, which each checkpoint checks (KeepDirectoryId); empty
  // and 0: not known, not checked (a store a test or the bench makes).
  std::string checkpoint_dir_id;
  uint64_t checkpoint_dir_device = 0;
  // A seam for tests: checkpoint parts with their arrays back to back, as
  // format version 1 wrote them (PartWriter::Open's array_alignment 0), so
  // that the restore's path for such parts stays tested.
  bool checkpoint_packed_arrays = false;
  // After a checkpoint completes, keep this many complete checkpoints of the
  // job and remove older steps (checkpoint::Prune); 0 keeps all.
  uint64_t checkpoint_keep = 0;
  // Told what happens to checkpoint files besides writing them: which one
  // a restore loaded, why it passed over newer, torn ones, which steps it
  // set aside, and which a prune removed.
  std::function<void(const std::string&)> checkpoint_log = [](const std::string& line) {
    log::Info("checkpoint_files", {{"detail", line}});
  };
  // A seam for tests: runs after each slice a checkpoint streams, without
  // the job's lock (job_snapshot.h), so a test can act while it streams.
  std::function<void()> after_snapshot_slice;
};

class JobStore {
 public:
  using PushSession = ::shardopt::PushSession;

  JobStore(Backend* backend, JobStoreOptions options = {});
  ~JobStore();

  // With a checkpoint_dir, a job not in memory is restored from its newest
  // complete checkpoint (or request.restore_step's), by the request's
  // placement: each shard is read from whichever parts cover it.
  // A job it builds (or restores) is charged to `owner` (tenant_ledger.h),
  // RESOURCE_EXHAUSTED past its cap; attaching to a job costs nothing.
  absl::StatusOr<v1::CreateJobResponse> CreateJob(const v1::CreateJobRequest& request, const JobOwner& owner = {})
      ABSL_LOCKS_EXCLUDED(mu_);
  // Writes this server's part of the job's checkpoint of request.step(),
  // from a snapshot taken at a step boundary. Its writer's buffers are
  // charged to the budget while it writes. A step half applied is waited for
  // until `deadline` (the caller's), then DEADLINE_EXCEEDED.
  absl::StatusOr<v1::CheckpointResponse> Checkpoint(const v1::CheckpointRequest& request,
                                                    absl::Time deadline = absl::InfiniteFuture())
      ABSL_LOCKS_EXCLUDED(mu_);
  // For SIGTERM: from now on commits that would apply a step fail with
  // UNAVAILABLE; commits already applying finish first, for up to
  // `wait_for_steps` in all. Then every job is checkpointed at its step, one
  // result each; a job still waiting for its initial values holds nothing a
  // restart could not rebuild and is skipped, logged as job_discarded; one
  // dropped while its part is written has no result either. A
  // job whose step is still half applied then (its committer stopped
  // reading the params) is
  // DEADLINE_EXCEEDED, not checkpointed: the others do not wait for it.
  std::vector<std::pair<std::string, absl::StatusOr<v1::CheckpointResponse>>> DrainAndCheckpoint(
      absl::Duration wait_for_steps = absl::Seconds(20)) ABSL_LOCKS_EXCLUDED(mu_);
  // For a stop without a checkpoint directory: logs the jobs held, whose
  // state ends with the process (job_discarded, one line per job for the
  // first 16 by name, then one with how many more).
  void LogDiscardedAtStop() const ABSL_LOCKS_EXCLUDED(mu_);
  // `incarnation` as Find's: a caller of another life of the job drops nothing.
  // A job a CreateJob is building is waited for, then dropped, and its life
  // marked dropped in the checkpoint directory.
  // With `only_if_empty`, a job that holds anything (a step done, any
  // initial value or Adam state) is PERMISSION_DENIED and stays: a
  // trainer's drop of a job it made afresh by mistake.
  absl::Status DropJob(const std::string& job, uint64_t incarnation = 0, bool only_if_empty = false)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A client's undo of one CreateJob of the life `incarnation` of `job`
  // (one that made or restored it, or attached to it), whose attach failed
  // on other servers. Only while Job::Untouched, else PERMISSION_DENIED;
  // then the job goes with the last of its CreateJobs undone, as if never
  // asked for: its life is not marked dropped, so a restored job's
  // checkpoints restore it again, under the same life.
  absl::Status UndoCreate(const std::string& job, uint64_t incarnation) ABSL_LOCKS_EXCLUDED(mu_);
  // One page of the job's tensors on this server, at most kDescribePage.
  static constexpr uint32_t kDescribePage = 4096;
  // What a Describe page leaves of the message limit for the fields set
  // after its tensors: a few hundred bytes at most.
  static constexpr uint64_t kDescribeMarginBytes = 4096;
  absl::StatusOr<v1::DescribeResponse> Describe(const v1::DescribeRequest& request) const ABSL_LOCKS_EXCLUDED(mu_);
  // The first page.
  absl::StatusOr<v1::DescribeResponse> Describe(const std::string& job) const ABSL_LOCKS_EXCLUDED(mu_) {
    v1::DescribeRequest request;
    request.set_job(job);
    return Describe(request);
  }

  // One page of the jobs held now whose names `visible` takes (the caller's
  // token's), in byte order of their names, at most kListPage. `visible`
  // runs under the store's lock: it must take no lock of its own.
  static constexpr uint32_t kListPage = 1000;
  v1::ListJobsResponse ListJobs(const v1::ListJobsRequest& request,
                                const std::function<bool(const std::string&)>& visible) const ABSL_LOCKS_EXCLUDED(mu_);

  // Writes one chunk of initial values (the master, or Adam's moments).
  // All-or-nothing: a chunk with a bad range or value changes nothing.
  // Returns the number of elements written. While a checkpoint streams the
  // job's state, it waits for it.
  absl::StatusOr<uint64_t> Init(const v1::InitChunk& chunk) ABSL_LOCKS_EXCLUDED(mu_);
  // Init that never waits: nullopt while a checkpoint streams the state,
  // and then `wake` runs when it is time to try again (Job::StateWritable).
  // `life`, if given, is set to the life of the job the chunk was for, which
  // an Init stream's later chunks that name none are of.
  absl::StatusOr<std::optional<uint64_t>> TryInit(const v1::InitChunk& chunk, const std::function<void()>& wake,
                                                  uint64_t* life = nullptr) ABSL_LOCKS_EXCLUDED(mu_);

  // One rank's push of one step: the stream's first message opens a session
  // (server/push_session.h).
  absl::StatusOr<std::unique_ptr<PushSession>> BeginPush(const v1::GradChunk& first) ABSL_LOCKS_EXCLUDED(mu_);

  // Applies the step if it is the next one, then hands the params to `emit`
  // in chunks, stopping early if `emit` returns false. `emit` runs without
  // any lock held (server/commit_stream.h).
  absl::Status Commit(const v1::CommitRequest& request, const std::function<bool(const v1::ParamChunk&)>& emit)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The same commit, pulled piece by piece (server/commit_stream.h). With a
  // `wake`, it never waits for a checkpoint streaming the state: it returns
  // null, and `wake` runs when it is time to call it again.
  absl::StatusOr<std::unique_ptr<ParamStream>> OpenCommit(const v1::CommitRequest& request,
                                                          const std::function<void()>& wake = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A range of one tensor's state, chunk by chunk, every chunk of one whole
  // step: pulled one at a time, so that a caller slow to take them holds no
  // thread (the service's Read reactor).
  class StateStream {
   public:
    enum class Pulled {
      kChunk,  // the next chunk is in `chunk`
      kEnd,    // the range is done
      kLater,  // a step is being applied: `wake` runs at the job's next change, to ask again
    };
    // The next chunk's fields into `chunk`, its data into the bytes
    // `data(size)` returns (a reactor's own slice, so that the bytes are
    // copied once, out of the state). Every chunk is of a whole step; while
    // one is half applied (its committer may take any time to read the
    // params) a null `wake` waits, and a gRPC reactor gives one instead, so
    // that it holds no thread meanwhile.
    absl::StatusOr<Pulled> Next(v1::StateChunk* chunk, absl::FunctionRef<char*(size_t)> data,
                                const std::function<void()>& wake = nullptr);

   private:
    friend class JobStore;
    std::shared_ptr<Job> job_;
    uint32_t shard_ = 0;
    StateKind kind_ = StateKind::kMaster;
    DType dtype_ = DType::kFp32;
    uint64_t base_ = 0, next_ = 0, end_ = 0, per_chunk_ = 0;
    std::string tensor_;
  };
  absl::StatusOr<std::unique_ptr<StateStream>> OpenRead(const v1::ReadRequest& request) const ABSL_LOCKS_EXCLUDED(mu_);
  // The same range pushed to `emit`, stopping early if it returns false.
  absl::Status Read(const v1::ReadRequest& request, const std::function<bool(const v1::StateChunk&)>& emit) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // What the jobs each owner made hold now (tenant_ledger.h), for the metrics' gauges.
  std::vector<std::pair<std::string, uint64_t>> TenantBytes() const { return tenants_.Held(); }

  // Where the last step done went, on this server (job.h).
  absl::StatusOr<StepPhases> LastStepPhases(const std::string& job) const ABSL_LOCKS_EXCLUDED(mu_);

  // A message holds the smallest piece of params a commit streams
  // (kApplyAlignment fp32 elements) twice over.
  static constexpr uint64_t kMinMessageBytes = 2 * 4 * kApplyAlignment;
  uint64_t max_message_bytes() const { return options_.max_message_bytes; }
  // The most bytes a commit message of several pieces holds
  // (CommitRequest.pack): one bf16 piece's, so a piece of that size or
  // more always goes alone.
  uint64_t packed_message_bytes() const { return options_.stream_chunk_elements * 2; }
  std::string backend_name() const { return backend_->Describe(); }
  uint32_t max_tensors_per_job() const { return options_.max_tensors_per_job; }
  // What jobs and streams charge their memory to.
  MemoryBudget* budget() { return &budget_; }
  // The thread that resumes waiting pushes; the service's stream timers run
  // on it too.
  Wakeups* wakeups() { return &wakeups_; }

 private:
  // job_discarded lines, one per name for the first 16, then one with how
  // many more, each saying `why`.
  static void LogDiscarded(const std::vector<std::string>& names, const char* why);
  absl::StatusOr<std::shared_ptr<Job>> Find(const std::string& name) const ABSL_LOCKS_EXCLUDED(mu_);
  // The same, for a caller that attached to life `incarnation` of the job
  // (0: any): another life is NOT_FOUND "was dropped", as the job it
  // attached to was.
  absl::StatusOr<std::shared_ptr<Job>> Find(const std::string& name, uint64_t incarnation) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // What Describe and ListJobs both say of a job.
  static v1::JobSummary Summarize(const Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu);
  absl::StatusOr<v1::CreateJobResponse> Attach(Job& job, const v1::CreateJobRequest& spec, uint32_t rank,
                                               uint64_t caller_life) const;
  // A CreateJob answer's step, sealed step, the arguments the step was
  // applied with, whether the round holds some of `rank`'s push, and this
  // server's own part of a torn step (of the life `caller_life`, the
  // request's incarnation, where that is nonzero).
  static void SetStepFields(const Job& job, uint32_t rank, uint64_t caller_life, v1::CreateJobResponse* response)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu);
  // Adds one to the job's series of `family`, if the store still holds this
  // job: a checkpoint that ends after its job was dropped would otherwise
  // bring back the series the drop removed.
  void CountForJob(const Job& job, const char* family) const ABSL_LOCKS_EXCLUDED(mu_);
  // Whether --checkpoint_dir is the directory this server started on
  // (checkpoint::KeepDirectoryId): checked before anything reads or writes
  // it, so that an unmounted volume is refused, not taken for an empty one.
  // OK where it is not known (JobStoreOptions::checkpoint_dir_id).
  absl::Status CheckpointDirInPlace() const;
  // Checkpoint, charging its buffers or not (the drain's: see DrainAndCheckpoint).
  absl::StatusOr<v1::CheckpointResponse> WriteCheckpoint(const v1::CheckpointRequest& request, bool charged,
                                                         absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu_);

  Backend* const backend_;
  JobStoreOptions options_;
  // Declared before the jobs, whose charges they outlive.
  MemoryBudget budget_;
  CheckpointBuffers checkpoint_buffers_{&budget_};
  TenantLedger tenants_;
  // Resumes waiting pushes. Declared before the jobs, so that it is
  // destroyed after them: a job posts to it until its last moment.
  Wakeups wakeups_;
  std::atomic<bool> draining_{false};
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  // The names of the last kDroppedKept jobs dropped here, oldest first, so
  // that a call for one says it was dropped: a client re-creates a job that
  // is merely unknown (this server restarted; it restores it), never one
  // that was dropped.
  static constexpr size_t kDroppedKept = 4096;
  // Each with whether it was dropped fresh: by a call naming its life
  // while it held nothing (no step, no initial value, nothing restored), as
  // a client drops the job its re-attach made afresh on a server that had
  // lost it, for the other trainers' calls to say so.
  std::deque<std::string> dropped_order_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, bool> dropped_ ABSL_GUARDED_BY(mu_);
  // NOT_FOUND for a job this server does not hold, saying whether it was dropped.
  absl::Status NoJob(const std::string& name) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Takes `job` out of the store and marks it dropped: NOT_FOUND if the
  // name holds another life now (another drop came first). With
  // `only_if_untouched`, PERMISSION_DENIED unless Job::Untouched, and one of
  // its attaches undone if others stand, the job kept (not marked dropped).
  // Whether the job went.
  absl::StatusOr<bool> Unpublish(Job& job, bool only_if_untouched) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // NOT_FOUND for a caller of another life of the job `name` holds now.
  static absl::Status OtherLife(const std::string& name, uint64_t incarnation);
  // The refusal once the drain has begun (draining_), saying to `what` once
  // the server is back: a job made, or initial values written, now could
  // come after the drain's checkpoint of it, and would be lost with the
  // process while the caller was told they were in.
  static absl::Status Draining(absl::string_view what);
  // Jobs being built by a CreateJob, outside the lock; `created_` is
  // signalled as each is done, in the map or failed.
  absl::flat_hash_set<std::string> creating_ ABSL_GUARDED_BY(mu_);
  absl::CondVar created_;
};

}  // namespace shardopt
