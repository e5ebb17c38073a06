// JobStore's checkpoints: one asked for by a client, and every job's at a
// drain. The part's bytes are checkpoint/'s; the snapshot is job_snapshot's.
#include <algorithm>
#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "checkpoint/direct_io.h"
#include "checkpoint/directory_id.h"
#include "checkpoint/format.h"
#include "checkpoint/job_directory.h"
#include "server/job_snapshot.h"
#include "server/job_store.h"
#include "server/log.h"
#include "server/messages.h"
#include "server/metrics.h"

namespace shardopt {

namespace {

// Whether `job` was dropped by now: a checkpoint of it that failed then was
// cut short on purpose (checkpoint_abandoned), not a failure to keep state.
bool DroppedSince(Job& job) {
  absl::MutexLock lock(&job.mu);
  return job.dropped;
}

}  // namespace

// What jobs leave free of the budget holds a Checkpoint call's buffers.
static_assert(checkpoint::SequentialWriter::kMostBytes <= MemoryBudget::kKeptAtLeast);

absl::StatusOr<v1::CheckpointResponse> JobStore::Checkpoint(const v1::CheckpointRequest& request, absl::Time deadline) {
  return WriteCheckpoint(request, /*charged=*/true, deadline);
}

absl::Status JobStore::CheckpointDirInPlace() const {
  if (options_.checkpoint_dir_id.empty()) return absl::OkStatus();  // nothing to keep (JobStoreOptions)
  return checkpoint::KeepDirectoryId(options_.checkpoint_dir, options_.checkpoint_dir_id,
                                     options_.checkpoint_dir_device);
}

absl::StatusOr<v1::CheckpointResponse> JobStore::WriteCheckpoint(const v1::CheckpointRequest& request, bool charged,
                                                                 absl::Time deadline) {
  if (options_.checkpoint_dir.empty()) {
    return absl::FailedPreconditionError("this server has no --checkpoint_dir");
  }
  SHARDOPT_ASSIGN_OR_RETURN(auto found, Find(request.job(), request.incarnation()));
  Job& job = *found;
  // One checkpoint of a job at a time here. A client whose deadline passed
  // during a slow one retries it while the first still writes: that retry
  // waits for it and then finds the step complete (or writes its part once
  // more, alone), instead of a second writer of the same part racing the
  // first's rename, with a manifest that may differ (a round sealed since),
  // under a COMMIT that lists the other's size.
  {
    absl::MutexLock lock(&job.mu);
    if (!job.mu.AwaitWithDeadline(absl::Condition(
                                      +[](Job* j) ABSL_EXCLUSIVE_LOCKS_REQUIRED(j->mu) { return !j->checkpointing; },
                                      &job),
                                  deadline)) {
      return absl::DeadlineExceededError(absl::StrCat("a checkpoint of job ", Quote(job.name()),
                                                      " is still being written on this server; ask again later"));
    }
    job.checkpointing = true;
  }
  absl::Cleanup written_or_not = [&job] {
    absl::MutexLock lock(&job.mu);
    job.checkpointing = false;
    job.Notify();  // an Init waits for it (Job::InitWritable)
  };
  // The writer's buffers are charged while it runs, as every allocation a
  // client's request makes is (memory_budget.h): once the step is known
  // good, so that a wrong step is FAILED_PRECONDITION whatever the budget.
  // A call may wait there for other jobs' checkpoints (checkpoint_buffers.h).
  CheckpointBuffers::Held buffers;
  // Timed from the snapshot's start: it streams most of the part. A
  // checkpoint that began ends in checkpoint_end or checkpoint_failed (or
  // checkpoint_abandoned, its job dropped meanwhile), and
  // so does one the budget has no room for: the job's state is no more
  // durable than if its write had failed, and the alert on failures must
  // see it (a job admitted within the buffers' size of the budget could
  // never be checkpointed but at the drain). One refused for the caller's
  // mistake (a wrong step), or whose wait for buffers the drain ended (the
  // drain checkpoints its job), is only in the service's refusal line.
  std::optional<std::chrono::steady_clock::time_point> t0;
  bool no_room = false;
  absl::StatusOr<std::unique_ptr<checkpoint::PartWriter>> writer = Snapshot(
      job, options_.checkpoint_dir, request.step(), deadline,
      options_.checkpoint_packed_arrays ? 0 : checkpoint::kDirectAlignment,
      [&]() -> absl::Status {
        if (charged) {
          auto reserved = checkpoint_buffers_.Take(checkpoint::SequentialWriter::kMostBytes,
                                                   absl::StrCat("a checkpoint of job ", Quote(job.name())), deadline);
          no_room = absl::IsResourceExhausted(reserved.status());
          SHARDOPT_ASSIGN_OR_RETURN(buffers, std::move(reserved));
        }
        log::Info("checkpoint_begin", {{"job", job.name()}, {"step", absl::StrCat(request.step())}});
        t0 = std::chrono::steady_clock::now();
        return CheckpointDirInPlace();
      },
      options_.after_snapshot_slice);
  if (!writer.ok() && !t0 && !no_room) return writer.status();
  absl::StatusOr<checkpoint::WriteResult> finished = writer.ok() ? (*writer)->Finish() : writer.status();
  if (writer.ok() && (*writer)->placed()) {
    absl::MutexLock lock(&job.mu);
    job.part_written = request.step();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0.value_or(std::chrono::steady_clock::now()))
          .count();
  if (!finished.ok()) {
    if (DroppedSince(job)) {
      // Dropped on purpose while its part was written: nothing meant to be
      // kept is lost, so no failure for the alert (nor the drain's exit 1).
      log::Info("checkpoint_abandoned", {{"job", job.name()},
                                         {"step", absl::StrCat(request.step())},
                                         {"why", "the job was dropped while its checkpoint was written"}});
      return finished.status();
    }
    log::Error("checkpoint_failed", {{"job", job.name()},
                                     {"step", absl::StrCat(request.step())},
                                     {"error", std::string(finished.status().message())}});
    CountForJob(job, "shardopt_checkpoint_failures_total");
    return finished.status();
  }
  const checkpoint::WriteResult& written = *finished;
  for (const std::string& why : written.passed_over) {
    options_.checkpoint_log(absl::StrCat("passed over a file that is no readable part, left where it is: ", why));
  }
  CountForJob(job, "shardopt_checkpoints_total");
  metrics::Registry::Default().Observe("shardopt_checkpoint_seconds", {{"direction", "write"}}, seconds);
  metrics::Registry::Default().Increment("shardopt_checkpoint_bytes_total", {{"direction", "write"}},
                                         static_cast<double>(written.part_bytes));
  log::Info("checkpoint_end", {{"job", job.name()},
                               {"step", absl::StrCat(request.step())},
                               {"directory", written.directory},
                               {"bytes", absl::StrCat(written.part_bytes)},
                               {"seconds", absl::StrCat(seconds)},
                               {"complete", written.complete ? "true" : "false"}});
  if (written.committed_here && options_.checkpoint_keep > 0) {
    for (const std::string& dir : checkpoint::Prune(options_.checkpoint_dir, job.name(), options_.checkpoint_keep)) {
      options_.checkpoint_log(absl::StrCat("pruned checkpoint ", dir, " (--checkpoint_keep=", options_.checkpoint_keep, ")"));
    }
  }
  v1::CheckpointResponse response;
  response.set_step(request.step());
  response.set_directory(written.directory);
  response.set_part_bytes(written.part_bytes);
  response.set_complete(written.complete);
  return response;
}

void JobStore::CountForJob(const Job& job, const char* family) const {
  absl::MutexLock lock(&mu_);  // as DropJob forgets the job's series
  if (auto it = jobs_.find(job.name()); it != jobs_.end() && it->second.get() == &job) {
    metrics::Registry::Default().Increment(family, {{"job", job.name()}});
  }
}

std::vector<std::pair<std::string, absl::StatusOr<v1::CheckpointResponse>>> JobStore::DrainAndCheckpoint(absl::Duration wait_for_steps) {
  draining_ = true;
  checkpoint_buffers_.StopWaiting(Draining("ask for the checkpoint again"));
  log::Info("drain", {{"detail", "commits that would apply a step are refused, but those of a sealed round; every "
                                  "job with all its initial values is checkpointed"}});
  std::vector<std::pair<std::string, std::shared_ptr<Job>>> jobs;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, job] : jobs_) jobs.emplace_back(name, job);
  }
  // No commit starts a step any more, but that of a sealed round; one
  // already applying finishes first, unless its committer stopped reading:
  // that one must not cost every other job its checkpoint (nor hold the
  // exit until SIGKILL).
  const absl::Time deadline = absl::Now() + wait_for_steps;
  std::vector<std::pair<std::shared_ptr<Job>, uint64_t>> at;
  std::vector<std::string> uninitialized;  // no checkpoint holds part of a job's initial values
  std::vector<std::pair<std::string, absl::StatusOr<v1::CheckpointResponse>>> results;
  for (const auto& [name, job] : jobs) {
    uint64_t step = 0;  // the last whole step: what its checkpoint would have held
    {
      absl::MutexLock job_lock(&job->mu);
      // A round sealed here (every rank's gradients in) is being committed
      // on the job's other servers, which go on to its step: its commit
      // applies here too before the step is taken, so that this server's
      // part is of the step they hold. Refused, as every commit was, it
      // left this server's part a step behind theirs, which no trainer
      // could complete (an outside probe's drains during commits lost the
      // job in most runs). Waited for until `deadline`, as applies are.
      bool whole = job->AwaitWholeStep(deadline);
      while (whole && job->round.active && job->round.sealed && !job->dropped &&
             !job->changed.WaitWithDeadline(&job->mu, deadline)) {
        whole = job->AwaitWholeStep(deadline);
      }
      job->drain_taken = true;
      if (whole) {
        if (job->dropped) continue;
        if (job->uninitialized_shards == 0) {
          at.emplace_back(job, job->step);
        } else {
          uninitialized.push_back(name);
        }
        continue;
      }
      step = job->step;
    }
    // Counted without the job's lock: the store's is taken before a job's.
    const absl::Status late = absl::DeadlineExceededError(
        absl::StrCat("job '", name, "' is still applying step ", step + 1, " after ",
                     absl::FormatDuration(wait_for_steps), ": its committer stopped reading the params; not checkpointed"));
    log::Error("checkpoint_failed", {{"job", name}, {"step", absl::StrCat(step)}, {"error", std::string(late.message())}});
    CountForJob(*job, "shardopt_checkpoint_failures_total");
    results.emplace_back(name, late);
  }
  std::sort(uninitialized.begin(), uninitialized.end());
  LogDiscarded(uninitialized, "not every shard has its initial values yet: nothing of it is checkpointed");
  for (const auto& [job, step] : at) {
    v1::CheckpointRequest request;
    request.set_job(job->name());
    request.set_step(step);
    // One at a time, their buffers uncharged: a full budget must not cost
    // the state at SIGTERM, and one checkpoint's buffers fit the headroom.
    absl::StatusOr<v1::CheckpointResponse> written = WriteCheckpoint(request, /*charged=*/false, absl::InfiniteFuture());
    if (!written.ok() && DroppedSince(*job)) continue;  // logged as checkpoint_abandoned
    results.emplace_back(job->name(), std::move(written));
  }
  return results;
}

void JobStore::LogDiscardedAtStop() const {
  std::vector<std::string> names;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [name, job] : jobs_) names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  LogDiscarded(names, "no --checkpoint_dir: its state ends with the process");
}

void JobStore::LogDiscarded(const std::vector<std::string>& names, const char* why) {
  constexpr size_t kNamed = 16;
  for (size_t i = 0; i < std::min(kNamed, names.size()); ++i) {
    log::Warning("job_discarded", {{"job", names[i]}, {"why", why}});
  }
  if (names.size() > kNamed) {
    log::Warning("job_discarded", {{"more", absl::StrCat(names.size() - kNamed)}, {"why", why}});
  }
}

}  // namespace shardopt
