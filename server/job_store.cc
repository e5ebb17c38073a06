#include "server/job_store.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "checkpoint/catalog.h"
#include "checkpoint/format.h"
#include "checkpoint/job_directory.h"
#include "rpc/initial_values.h"
#include "server/commit_stream.h"
#include "server/job_life.h"
#include "server/job_snapshot.h"
#include "server/job_spec.h"
#include "server/messages.h"
#include "server/metrics.h"

namespace shardopt {
JobStore::JobStore(Backend* backend, JobStoreOptions options)
    : backend_(backend), options_(options),
      budget_(options.memory_limit > 0 ? options.memory_limit : MemoryBudget::DefaultLimit()) {
  // A commit applies the update one streamed piece at a time; pieces must
  // start where a partial update may. The rest of a message is room for its
  // other fields (4 B/element: FP32 params, or a read of the fp32 state).
  const uint64_t a = kApplyAlignment;
  const uint64_t fits = options_.max_message_bytes / 2 / 4;
  options_.stream_chunk_elements = std::max(a, std::min(options_.stream_chunk_elements, fits) / a * a);
}

JobStore::~JobStore() = default;

absl::Status JobStore::NoJob(const std::string& name) const {
  const auto dropped = dropped_.find(name);
  if (dropped == dropped_.end()) return absl::NotFoundError(absl::StrCat("no job ", Quote(name), " on this server"));
  if (!dropped->second) return absl::NotFoundError(absl::StrCat("job ", Quote(name), " was dropped on this server"));
  // Not "dropped" alone, which reads as an admin's drop on purpose (an
  // outside probe's second rank, after the first rank's re-attach).
  return absl::NotFoundError(absl::StrCat(
      "job ", Quote(name), " was dropped on this server by a client that named its life while it held nothing: ",
      "most likely a trainer's re-attach that found this server without the job or a checkpoint of it (it ",
      "restarted), so that this server's part of the job's state is lost (that trainer's error says so); then drop ",
      "the job on every server (shardopt --server=HOST:PORT drop JOB) and start it again, from a checkpoint ",
      "elsewhere if there is one (restore_step). (Clients older than DropJobRequest.undo also dropped so a job ",
      "whose attach failed on another server.)"));
}

absl::StatusOr<std::shared_ptr<Job>> JobStore::Find(const std::string& name) const {
  // As CreateJob refuses it: no job has this name ("no job ''" read as a lookup that failed).
  if (name.empty()) return absl::InvalidArgumentError("the request names no job (its job is empty)");
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(name);
  if (it == jobs_.end()) return NoJob(name);
  return it->second;
}

absl::StatusOr<std::shared_ptr<Job>> JobStore::Find(const std::string& name, uint64_t incarnation) const {
  SHARDOPT_ASSIGN_OR_RETURN(auto job, Find(name));
  if (incarnation != 0 && incarnation != job->incarnation) return OtherLife(name, incarnation);
  return job;
}

absl::Status JobStore::OtherLife(const std::string& name, uint64_t incarnation) {
  // Not "no job": the client would make the job again (Reattach) and go on
  // in this life as if it were the one it attached to. The lives before
  // are not kept, so a life that never was is answered alike, and said so.
  return absl::NotFoundError(absl::StrCat("job ", Quote(name), " is not the life this call names (incarnation ",
                                          incarnation, "): it was dropped on this server and made again since this ",
                                          "trainer attached to it, or a restore_step started a new run of it (or that ",
                                          "was never its life), and the one of the name now is another run's ",
                                          "(CreateOrAttach would join that run at its step)"));
}


absl::StatusOr<v1::CreateJobResponse> JobStore::Attach(Job& job, const v1::CreateJobRequest& spec,
                                                       uint32_t rank, uint64_t caller_life) const {
  SHARDOPT_RETURN_IF_ERROR(SameJobSpec(job.spec, spec));
  absl::MutexLock job_lock(&job.mu);
  ++job.attaches;
  v1::CreateJobResponse response;
  response.set_created(false);
  response.set_barrier_timeout_ms(job.spec.barrier_timeout_ms());
  SetStepFields(job, rank, caller_life, &response);
  return response;
}

void JobStore::SetStepFields(const Job& job, uint32_t rank, uint64_t caller_life,
                             v1::CreateJobResponse* response) {
  response->set_step(job.step);
  response->set_incarnation(job.incarnation);
  response->set_push_clock(job.push_clock);
  response->set_sealed_step(job.sealed_step);
  response->set_applied_lr(job.applied.lr);
  response->set_applied_gscale(job.applied.gscale);
  response->set_applied_skip(job.applied.skip);
  for (double lr : job.applied.group_lr) response->add_applied_group_lr(lr);
  // What of the rank's push stands: not what a cut-off stream will take
  // back (RunningSum::Withdraw), only what is finished or summed already,
  // and only before the deadline: a round past it ends at the next push
  // (every trainer of the job died), and that push is the new trainer's.
  // NormalizeJobSpec refused a rank past the world size.
  const Job::Round& r = job.round;
  response->set_rank_pushed(r.active && !r.sealed && std::chrono::steady_clock::now() < r.deadline &&
                            r.sum != nullptr && (r.sum->finished(rank) || r.sum->folded(rank)));
  // Until the first seal, which sets such a part aside: a trainer whose
  // peers still hold that step completes it there, then comes back for it.
  // Of the caller's life where it names one (then also of the job's own
  // step: a job made afresh at step 0 over its drained part of 0), else any
  // newer than the job's step.
  for (const auto& [t, life] : job.own_torn_parts) {
    if (caller_life != 0 ? life == caller_life : t > job.step) {
      response->set_own_part_step(t);
      break;
    }
  }
}

absl::Status JobStore::Draining(absl::string_view what) {
  return absl::UnavailableError(absl::StrCat("the server is shutting down (SIGTERM) and checkpointing its jobs; ", what,
                                             " once it is back"));
}

absl::StatusOr<v1::CreateJobResponse> JobStore::CreateJob(const v1::CreateJobRequest& request, const JobOwner& owner) {
  if (draining_) return Draining(absl::StrCat("create or attach job ", Quote(request.job()), " again"));
  // Before anything is built from the request: a small request must not make
  // the server build a large job.
  if (static_cast<uint64_t>(request.tensors_size()) > options_.max_tensors_per_job) {
    return absl::ResourceExhaustedError(absl::StrCat("job ", Quote(request.job()), " has ", request.tensors_size(),
                                                     " tensors; this server takes at most ",
                                                     options_.max_tensors_per_job, " (--max_tensors_per_job)"));
  }
  // A group per tensor is the most a job can use; each costs the server its
  // hyperparameters and name, and comes back in every Describe.
  if (static_cast<uint64_t>(request.groups_size()) > options_.max_tensors_per_job) {
    return absl::ResourceExhaustedError(absl::StrCat("job ", Quote(request.job()), " has ", request.groups_size(),
                                                     " groups; this server takes at most ",
                                                     options_.max_tensors_per_job, " (--max_tensors_per_job)"));
  }
  if (request.world_size() > options_.max_world_size) {
    return absl::ResourceExhaustedError(absl::StrCat("job ", Quote(request.job()), " has world_size ",
                                                     request.world_size(), "; this server takes at most ",
                                                     options_.max_world_size, " (--max_world_size)"));
  }
  const auto too_long = [&](const std::string& name, const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(what, " ", QuoteWithSize(name), " is longer than this server takes: ",
                                                   "at most ", options_.max_name_bytes, " (--max_name_bytes)"));
  };
  if (request.job().size() > options_.max_name_bytes) return too_long(request.job(), "job name");
  for (const v1::Group& g : request.groups()) {
    if (g.name().size() > options_.max_name_bytes) return too_long(g.name(), "group name");
  }
  for (const v1::TensorSpec& t : request.tensors()) {
    if (t.name().size() > options_.max_name_bytes) return too_long(t.name(), "tensor name");
  }
  SHARDOPT_ASSIGN_OR_RETURN(auto spec, NormalizeJobSpec(request, options_.default_barrier_timeout));
  const uint64_t restore_step = spec.restore_step();
  const uint32_t rank = spec.rank();
  const uint64_t reattaching = spec.incarnation();
  const std::optional<uint64_t> own_part =
      spec.has_own_part_step() ? std::optional<uint64_t>(spec.own_part_step()) : std::nullopt;
  spec.clear_own_part_step();
  if (own_part && (reattaching == 0 || restore_step != 0)) {
    return absl::InvalidArgumentError("own_part_step is a re-attach's: it needs the trainer's incarnation, and no "
                                      "restore_step");
  }
  spec.clear_restore_step();
  spec.clear_rank();
  spec.clear_incarnation();
  {
    absl::MutexLock lock(&mu_);
    // Every rank creates the job at once: one builds it (and restores it)
    // while the others wait for it and attach, rather than each charging,
    // allocating and restoring a job of its own (most of which the budget
    // would refuse).
    while (creating_.contains(spec.job())) created_.Wait(&mu_);
    if (auto it = jobs_.find(spec.job()); it != jobs_.end()) {
      auto attached = Attach(*it->second, spec, rank, reattaching);
      if (attached.ok()) log::Info("job_attached", {{"job", spec.job()}, {"step", absl::StrCat(attached->step())}});
      return attached;
    }
    creating_.insert(spec.job());
  }
  absl::Cleanup built = [this, &spec] {
    absl::MutexLock lock(&mu_);
    creating_.erase(spec.job());
    created_.SignalAll();
  };
  {
    // Every Describe page repeats the groups, each with what it holds, and
    // takes one tensor at least: a job whose groups leave no room for that
    // could never be described (an outside probe's 560 groups of 200-byte
    // names fit a CreateJob of a 128 KiB limit, and no Describe of it).
    // Checked for the job made, not at each attach, whose group names may
    // differ and are not compared.
    v1::DescribeResponse page;
    for (const v1::Group& g : spec.groups()) {
      v1::GroupState* held = page.add_groups();
      *held->mutable_config() = g;
      held->set_state_dtype(v1::FP32);
    }
    const uint64_t bytes = page.ByteSizeLong() + 2 * uint64_t{options_.max_name_bytes} + 64 + kDescribeMarginBytes;
    if (bytes > options_.max_message_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "job ", Quote(request.job()), ": its ", spec.groups_size(), " groups take ", page.ByteSizeLong(),
          " bytes of every Describe answer, which leaves no room for a tensor under this server's ",
          "--max_message_bytes (", options_.max_message_bytes, "): give fewer groups, or shorter names"));
    }
  }
  // What the directory holds decides what the job is (restored, a life
  // dropped, a new run): read only from the volume this server started on.
  if (!options_.checkpoint_dir.empty()) SHARDOPT_RETURN_IF_ERROR(CheckpointDirInPlace());
  // The old trainer of a life dropped on purpose, whose server restarted
  // since (and so remembers no drop but the mark on disk): nothing is
  // restored for it. A new run asks with no life and restores the newest
  // checkpoint under a new one.
  if (reattaching != 0 && !options_.checkpoint_dir.empty() &&
      checkpoint::LifeDropped(options_.checkpoint_dir, spec.job(), reattaching)) {
    return absl::NotFoundError(absl::StrCat("job ", Quote(spec.job()), " was dropped (its life ", reattaching,
                                            " is marked dropped in --checkpoint_dir); not restored for its old "
                                            "trainer: a new run makes it again"));
  }
  if (own_part && options_.checkpoint_dir.empty()) {
    return absl::FailedPreconditionError("own_part_step asked for, but this server has no --checkpoint_dir");
  }
  if (restore_step > 0 && options_.checkpoint_dir.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("restore_step ", restore_step,
                                                      " asked for, but this server has no --checkpoint_dir"));
  }

  // An attach that says no G (a reader, a plain client) restores the job
  // with its checkpoint's: the job's spec is fixed before the restore reads
  // it, and holding 0 would let nodes of any G in after such an attach.
  if (spec.trainers_per_rank() == 0 && !options_.checkpoint_dir.empty()) {
    const auto found = checkpoint::FindCommitted(options_.checkpoint_dir, spec.job(), restore_step, [](auto&) {});
    if (found.ok()) spec.set_trainers_per_rank(checkpoint::TrainersPerRank(*found));
  }
  // A few chunks per rank are enough for the ranks to stream as a wavefront.
  const uint64_t window = std::max<uint64_t>(RunningSum::MinWindowBytes(),
                                             std::min(options_.window_bytes, uint64_t{spec.world_size()} << 22));
  SHARDOPT_ASSIGN_OR_RETURN(auto created,
                            Job::Create(spec, backend_, window, &wakeups_, &budget_, &tenants_, owner));
  std::shared_ptr<Job> job = std::move(created);

  // Outside the store's lock: reading a checkpoint must not stall other jobs.
  bool restored = false;
  uint64_t restored_step = 0;
  if (!options_.checkpoint_dir.empty()) {
    absl::MutexLock job_lock(&job->mu);
    const auto t0 = std::chrono::steady_clock::now();
    const absl::Status loaded = own_part ? Restore(options_.checkpoint_dir, *own_part, options_.checkpoint_log,
                                                   *job, reattaching)
                                         : Restore(options_.checkpoint_dir, restore_step, options_.checkpoint_log, *job);
    if (loaded.ok()) {
      restored = true;
      restored_step = job->step;
      job->restored_from = Job::PartsRead{job->step, job->incarnation};
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const uint64_t bytes = job->state->memory_use().state_bytes;
      metrics::Registry::Default().Observe("shardopt_checkpoint_seconds", {{"direction", "restore"}}, seconds);
      metrics::Registry::Default().Increment("shardopt_checkpoint_bytes_total", {{"direction", "restore"}},
                                             static_cast<double>(bytes));
      log::Info("job_restored", {{"job", spec.job()},
                                 {"step", absl::StrCat(job->step)},
                                 {"directory", checkpoint::StepDirectory(options_.checkpoint_dir, spec.job(), job->step)},
                                 {"bytes", absl::StrCat(bytes)},
                                 {"seconds", absl::StrCat(seconds)}});
      // A restore_step that goes back starts a new run: before any client
      // sees the job, the old run's newer steps go out of its way. Not after
      // a restore of the newest: a newer torn step may be one that a peer
      // still completes (a drain during an upgrade).
      if (restore_step > 0) {
        SHARDOPT_ASSIGN_OR_RETURN(auto set_aside,
                                  checkpoint::SetAsideNewerSteps(options_.checkpoint_dir, spec.job(), job->step));
        for (const std::string& line : set_aside) options_.checkpoint_log(line);
        job->set_aside_steps = !set_aside.empty();
      }
    } else if (loaded.code() != absl::StatusCode::kNotFound || restore_step > 0 || own_part) {
      return loaded;  // the job, partly written, is thrown away
    }
    // A part of this server's own in a torn step newer than the job's is
    // another run's once this job goes on from its step, and the new run's
    // peers' parts of that step must not be tiled with it. Not now: a peer
    // may still hold that run and complete the step (a drain while its
    // peers train on, this server's restore then refused by the client).
    // At the job's first seal: a client commits a step on a server only
    // with every server's push answer of it, and each server answers only
    // once it has sealed, so no server of this run applies (or writes a
    // part of) a step past this one before every server has run this.
    if (spec.shards_size() > 0) {
      job->before_first_seal = [dir = options_.checkpoint_dir, log = options_.checkpoint_log](
                                   const v1::CreateJobRequest& placed, uint64_t step) {
        return checkpoint::SetAsideOwnNewerParts(dir, placed, step, log);
      };
      job->own_torn_parts = checkpoint::OwnTornParts(options_.checkpoint_dir, job->spec, job->step);
    }
  }

  // The job's life. A fresh job, or a run started from a restore_step the
  // caller chose: a new one. A restore of the newest: the checkpoint's,
  // unless that life was dropped on purpose (marked on disk, also before
  // this server restarted), whose trainers must not go on in the job made
  // again: then the life after it, which a restart before the new run
  // checkpoints gives again.
  uint64_t life = NewLife();
  if (restored && restore_step == 0) {
    life = job->incarnation != 0 ? job->incarnation : LifeOfUnnamedPart(spec.job(), restored_step);
    while (checkpoint::LifeDropped(options_.checkpoint_dir, spec.job(), life)) life = NextLife(life);
  }
  job->incarnation = life;
  absl::MutexLock lock(&mu_);
  jobs_.emplace(spec.job(), job);  // none of the name: this call was its one builder
  // From 0, so that an alert on their rates sees the job's first skip, or
  // checkpoint, or failed checkpoint (where there are checkpoints); and
  // when, so that one sees an event before the series' first scrape.
  metrics::Registry& registry = metrics::Registry::Default();
  registry.Increment("shardopt_skipped_steps_total", {{"job", spec.job()}}, 0);
  if (!options_.checkpoint_dir.empty()) {
    registry.Increment("shardopt_checkpoints_total", {{"job", spec.job()}}, 0);
    registry.Increment("shardopt_checkpoint_failures_total", {{"job", spec.job()}}, 0);
  }
  registry.SetGauge("shardopt_job_created_timestamp_seconds", {{"job", spec.job()}},
                    absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
  dropped_.erase(spec.job());       // made again: no longer a dropped one (its name may stay in the order)
  if (!restored) {
    log::Info("job_created", {{"job", spec.job()},
                              {"world_size", absl::StrCat(spec.world_size())},
                              {"tensors", absl::StrCat(spec.tensors_size())},
                              {"shards_here", absl::StrCat(job->shards.size())}});
  }
  v1::CreateJobResponse response;
  response.set_created(true);
  response.set_restored(restored);
  response.set_barrier_timeout_ms(spec.barrier_timeout_ms());
  absl::MutexLock job_lock(&job->mu);
  job->attaches = 1;
  SetStepFields(*job, rank, reattaching, &response);
  return response;
}

absl::StatusOr<uint64_t> JobStore::Init(const v1::InitChunk& chunk) {
  SHARDOPT_ASSIGN_OR_RETURN(const std::optional<uint64_t> written, TryInit(chunk, nullptr));
  return *written;  // a null wake waits: never nullopt
}

absl::StatusOr<std::optional<uint64_t>> JobStore::TryInit(const v1::InitChunk& chunk,
                                                          const std::function<void()>& wake, uint64_t* life) {
  SHARDOPT_ASSIGN_OR_RETURN(auto found, Find(chunk.job(), chunk.incarnation()));
  Job& job = *found;
  if (life != nullptr) *life = job.incarnation;
  SHARDOPT_ASSIGN_OR_RETURN(auto dtype, FromProto(chunk.dtype()));
  StateKind kind = StateKind::kMaster;
  switch (chunk.kind()) {
    case v1::STATE_KIND_UNSPECIFIED:
    case v1::MASTER: break;
    case v1::EXP_AVG: kind = StateKind::kExpAvg; break;
    case v1::EXP_AVG_SQ: kind = StateKind::kExpAvgSq; break;
    default: return absl::InvalidArgumentError("Init sets MASTER, EXP_AVG or EXP_AVG_SQ; params follow the master");
  }
  SHARDOPT_RETURN_IF_ERROR(CheckDataLength(chunk.data().size(), dtype, "init chunk"));
  const uint64_t count = chunk.data().size() / DTypeSize(dtype);
  // A BF16 group keeps the value rounded to bf16: an fp32 value finite as
  // sent may round to Inf there, which is checked as what would be kept.
  // (The spec and tensor index are fixed at creation: no lock.)
  bool bf16_state = false;
  if (auto t = job.tensor_index.find(chunk.tensor()); t != job.tensor_index.end()) {
    bf16_state = job.spec.groups(job.spec.tensors(t->second).group()).precision() == v1::PRECISION_BF16;
  }
  const InitialKind initial = kind == StateKind::kExpAvg     ? InitialKind::kExpAvg
                              : kind == StateKind::kExpAvgSq ? InitialKind::kExpAvgSq
                                                             : InitialKind::kMaster;
  SHARDOPT_RETURN_IF_ERROR(CheckInitialValues(chunk.data().data(), count, dtype == DType::kFp32, bf16_state, initial,
                                              Quote(chunk.tensor()), chunk.offset()));
  SHARDOPT_RETURN_IF_ERROR(CheckAdamStep(chunk.adam_step(), Quote(chunk.tensor())));
  absl::MutexLock lock(&job.mu);
  if (!job.InitWritable(wake)) return std::nullopt;  // a checkpoint of step 0 keeps the values it began with
  // Under the job's lock, held from here to the write (StateWritable may
  // have let it go while it waited), which the drain takes after it began,
  // to see whether the job's initial values are in: a value written after
  // that would be in neither its decision nor its checkpoint.
  if (draining_) {
    return Draining(absl::StrCat("call CreateOrAttach for job ", Quote(chunk.job()), " and send its initial values again"));
  }
  SHARDOPT_RETURN_IF_ERROR(job.CheckNotDropped());
  if (job.step != 0 || job.applying) {
    return absl::FailedPreconditionError(absl::StrCat("job '", job.name(), "' is ",
                                                      job.applying ? absl::StrCat("applying step ", job.step + 1)
                                                                   : absl::StrCat("at step ", job.step),
                                                      "; initial values are taken only at step 0"));
  }
  SHARDOPT_ASSIGN_OR_RETURN(auto shard, job.LocateRange(chunk.tensor(), chunk.offset(), count));
  const OwnedShard& s = job.shards[shard];
  const uint64_t local = chunk.offset() - s.offset;
  // The first write into a state that a checkpoint of step 0 holds (the job
  // was restored from it, or this server wrote its part of it) makes that
  // checkpoint another state's: left complete, a restart would restore the
  // values from before this write under trainers that sent the new ones.
  // It is set aside first; a failure to leaves the state unwritten.
  if (job.part_written == job.step ||
      (job.restored_from && job.restored_from->step == job.step && !job.restored_from->changed)) {
    SHARDOPT_RETURN_IF_ERROR(
        checkpoint::SetAsideStepOfOldValues(options_.checkpoint_dir, job.spec, job.step, options_.checkpoint_log));
    job.part_written.reset();
  }
  if (job.restored_from) job.restored_from->changed = true;  // even if the write fails partway
  SHARDOPT_RETURN_IF_ERROR(job.state->WriteState(shard, kind, local, dtype, chunk.data().data(), count));
  job.written = true;
  if (chunk.adam_step() != 0) job.adam_steps[shard] = chunk.adam_step();
  // Only the master makes a shard ready to step: moments default to zero.
  if (kind != StateKind::kMaster) return count;
  const bool was_covered = job.init_cover[shard].Covers(0, s.length);
  job.init_cover[shard].Add(local, local + count);
  if (!was_covered && job.init_cover[shard].Covers(0, s.length)) --job.uninitialized_shards;
  return count;
}

absl::StatusOr<std::unique_ptr<PushSession>> JobStore::BeginPush(const v1::GradChunk& first) {
  SHARDOPT_ASSIGN_OR_RETURN(auto found, Find(first.job(), first.incarnation()));
  return PushSession::Begin(std::move(found), first);
}

absl::StatusOr<StepPhases> JobStore::LastStepPhases(const std::string& name) const {
  SHARDOPT_ASSIGN_OR_RETURN(auto job, Find(name));
  absl::MutexLock lock(&job->mu);
  return job->last_phases;
}

absl::Status JobStore::Commit(const v1::CommitRequest& request,
                              const std::function<bool(const v1::ParamChunk&)>& emit) {
  SHARDOPT_ASSIGN_OR_RETURN(auto found, Find(request.job(), request.incarnation()));
  return CommitAndStream(std::move(found), request, {options_.stream_chunk_elements, draining_.load()}, emit);
}

absl::StatusOr<std::unique_ptr<ParamStream>> JobStore::OpenCommit(const v1::CommitRequest& request,
                                                                   const std::function<void()>& wake) {
  SHARDOPT_ASSIGN_OR_RETURN(auto found, Find(request.job(), request.incarnation()));
  return ParamStream::Open(std::move(found), request, {options_.stream_chunk_elements, draining_.load()}, wake);
}

}  // namespace shardopt
