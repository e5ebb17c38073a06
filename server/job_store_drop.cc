// JobStore's taking of jobs out: DropJob, the undo of a CreateJob, and
// what both share (Unpublish).
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "checkpoint/job_directory.h"
#include "server/job_life.h"
#include "server/job_store.h"
#include "server/log.h"
#include "server/messages.h"
#include "server/metrics.h"

namespace shardopt {

absl::Status JobStore::DropJob(const std::string& name, uint64_t incarnation, bool only_if_empty) {
  {
    // A job a CreateJob is building (a restore may take seconds) is dropped
    // once built: a NOT_FOUND now would be followed by the job appearing. (A
    // CreateJob that begins after this wait comes after the drop.)
    absl::MutexLock lock(&mu_);
    while (creating_.contains(name)) created_.Wait(&mu_);
  }
  SHARDOPT_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, Find(name, incarnation));
  const bool fresh = [&] {
    absl::MutexLock lock(&job->mu);
    return incarnation != 0 && job->step == 0 && !job->written && !job->restored_from;
  }();
  if (only_if_empty) {
    absl::MutexLock lock(&job->mu);
    if (job->step > 0 || job->written) {
      return absl::PermissionDeniedError(absl::StrCat("job ", Quote(name), " holds state: only an admin token may ",
                                                      "drop it (a trainer may drop only a job whose life it names ",
                                                      "that holds nothing yet)"));
    }
    // Dropped from here on, so that no Init writes into it in between: what
    // goes is empty. Taken back below if the drop cannot be marked.
    job->dropped = true;
  }
  // The life is marked dropped on disk before the job goes, outside the
  // store's lock: no job of the name can be made (and restore this life)
  // while it is still here, and a drop that cannot be marked does not happen.
  if (!options_.checkpoint_dir.empty()) {
    absl::Status marked = CheckpointDirInPlace();
    if (marked.ok()) marked = checkpoint::MarkLifeDropped(options_.checkpoint_dir, name, job->incarnation);
    if (!marked.ok()) {
      if (only_if_empty) {
        absl::MutexLock lock(&job->mu);
        job->dropped = false;
      }
      return absl::Status(marked.code(), absl::StrCat("job ", Quote(name), " is not dropped: its life could not be ",
                                                      "marked dropped in the checkpoint directory: ", marked.message()));
    }
  }
  {
    absl::MutexLock lock(&mu_);
    SHARDOPT_RETURN_IF_ERROR(Unpublish(*job, /*only_if_untouched=*/false).status());
    if (dropped_.insert_or_assign(name, fresh).second) dropped_order_.push_back(name);
    if (dropped_order_.size() > kDroppedKept) {
      dropped_.erase(dropped_order_.front());
      dropped_order_.pop_front();
    }
  }
  absl::MutexLock lock(&job->mu);
  job->Notify();
  log::Info("job_dropped", {{"job", name}, {"step", absl::StrCat(job->step)}});
  return absl::OkStatus();
}

absl::Status JobStore::UndoCreate(const std::string& name, uint64_t incarnation) {
  if (incarnation == 0) {
    return absl::InvalidArgumentError(absl::StrCat("an undo of job ", Quote(name), " names the life it undoes ",
                                                   "(DropJobRequest.incarnation, from its CreateJobResponse)"));
  }
  SHARDOPT_ASSIGN_OR_RETURN(std::shared_ptr<Job> job, Find(name, incarnation));
  {
    absl::MutexLock lock(&mu_);
    SHARDOPT_ASSIGN_OR_RETURN(const bool gone, Unpublish(*job, /*only_if_untouched=*/true));
    if (!gone) return absl::OkStatus();  // another attach of it stands
  }
  absl::MutexLock lock(&job->mu);
  job->Notify();
  log::Info("job_create_undone", {{"job", name}, {"step", absl::StrCat(job->step)}});
  return absl::OkStatus();
}

absl::StatusOr<bool> JobStore::Unpublish(Job& job, bool only_if_untouched) {
  auto it = jobs_.find(job.name());
  if (it == jobs_.end() || it->second.get() != &job) return NoJob(job.name());  // another drop came first
  {
    // Checked and marked under the job's lock, which a push, an Init or a
    // commit holds: none comes in between, and one ending now sees the
    // mark and counts nothing.
    absl::MutexLock job_lock(&job.mu);
    if (only_if_untouched) {
      if (!job.Untouched()) {
        return absl::PermissionDeniedError(absl::StrCat(
            "job ", Quote(job.name()), " holds something since this server made or restored it (a step, an ",
            "initial value, a push, or newer steps its restore_step set aside): its create is not undone; a ",
            "DropJob without undo drops it, where the caller may"));
      }
      // One attach undone; the job goes with the last (attaches counts the
      // CreateJob that made it too).
      if (job.attaches > 1) {
        --job.attaches;
        return false;
      }
    }
    job.dropped = true;
  }
  jobs_.erase(it);
  // Under the store's lock, as a CreateJob's zero counters are made: a job
  // of the name made again at once keeps its own series.
  metrics::Registry::Default().ForgetJob(job.name());
  return true;
}

}  // namespace shardopt
