#include "checkpoint/job_directory.h"

#include <cerrno>
#include <cstdio>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "checkpoint/catalog.h"
#include "checkpoint/files.h"

namespace shardopt::checkpoint {

namespace fs = std::filesystem;

namespace {
constexpr std::string_view kDroppedLifePrefix = "dropped-life-";
std::string DroppedLifeName(uint64_t incarnation) { return absl::StrFormat("%s%016x", kDroppedLifePrefix, incarnation); }
}  // namespace

bool IsDroppedLifeMark(std::string_view file_name) { return file_name.substr(0, kDroppedLifePrefix.size()) == kDroppedLifePrefix; }

absl::Status MarkLifeDropped(const std::string& root, const std::string& job, uint64_t incarnation) {
  const std::string dir = JobDirectory(root, job);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return absl::OkStatus();
  return WriteFileAtomic(dir, DroppedLifeName(incarnation), {});
}

bool LifeDropped(const std::string& root, const std::string& job, uint64_t incarnation) {
  std::error_code ec;
  return fs::exists(absl::StrCat(JobDirectory(root, job), "/", DroppedLifeName(incarnation)), ec);
}

std::vector<std::string> Prune(const std::string& root, const std::string& job, uint64_t keep) {
  std::vector<std::string> removed;
  uint64_t complete = 0;
  std::error_code ec;
  for (uint64_t step : StepsNewestFirst(JobDirectory(root, job))) {
    const std::string dir = StepDirectory(root, job, step);
    if (complete >= keep) {
      // COMMIT first: a prune cut short (a crash) then leaves a torn step,
      // passed over, never a COMMIT whose parts are partly gone (DATA_LOSS).
      // Another server of the job may prune the same directory at once.
      fs::remove(absl::StrCat(dir, "/", kCommitName), ec);
      if (FsyncDirectory(dir).ok() && fs::remove_all(dir, ec) != static_cast<std::uintmax_t>(-1) && !ec) {
        removed.push_back(dir);
      }
    } else if (fs::exists(absl::StrCat(dir, "/", kCommitName), ec)) {
      ++complete;
    }
  }
  return removed;
}

absl::StatusOr<std::vector<std::string>> SetAsideNewerSteps(const std::string& root, const std::string& job,
                                                            uint64_t step) {
  const std::string job_dir = JobDirectory(root, job);
  std::vector<uint64_t> newer = StepsNewestFirst(job_dir);
  newer.erase(std::find_if(newer.begin(), newer.end(), [step](uint64_t t) { return t <= step; }), newer.end());
  // Only a step that goes back, past a complete checkpoint, starts a new
  // run; with none newer, `step` is the newest, and newer torn steps may be
  // a peer's still being completed.
  if (std::none_of(newer.begin(), newer.end(), [&](uint64_t t) { return StepCommitted(root, job, t); })) {
    return std::vector<std::string>{};
  }
  std::vector<std::string> done;
  for (uint64_t t : newer) {
    const std::string dir = StepDirectory(root, job, t);
    const std::string aside = absl::StrFormat("%s/abandoned-%s-%d", job_dir, fs::path(dir).filename().string(),
                                              absl::ToUnixNanos(absl::Now()));
    // Every server of the job restores at once, so another may have moved
    // it first (ENOENT).
    if (rename(dir.c_str(), aside.c_str()) == 0) {
      done.push_back(absl::StrCat("set aside checkpoint ", dir, " as ", aside));
    } else if (const int error = errno; error != ENOENT) {
      return ErrnoStatus(error, absl::StrCat("cannot set aside ", dir, " (restore_step ", step,
                                             " starts a new run; move it away) as ", aside));
    }
  }
  // Whoever moved them, they must stay moved before the job is served.
  SHARDOPT_RETURN_IF_ERROR(FsyncDirectory(job_dir));
  return done;
}

std::vector<std::pair<uint64_t, uint64_t>> OwnTornParts(const std::string& root, const v1::CreateJobRequest& spec,
                                                        uint64_t step) {
  const std::string own = PartName(spec);
  std::vector<std::pair<uint64_t, uint64_t>> found;
  std::error_code ec;
  for (uint64_t t : StepsNewestFirst(JobDirectory(root, spec.job()))) {
    if (t < step) break;
    const std::string dir = StepDirectory(root, spec.job(), t);
    const std::string part = absl::StrCat(dir, "/", own);
    if (fs::exists(absl::StrCat(dir, "/", kCommitName), ec) || !fs::exists(part, ec)) continue;
    const auto head = ReadPartHead(part);
    found.emplace_back(t, head.ok() ? head->manifest.incarnation() : 0);
  }
  return found;
}

namespace {

// Renames `dir`/`name` into the job's directory as "abandoned-<step
// directory>-<name>-<nanoseconds>"; `moved` is set if it did. A file that
// is not there is no error.
absl::Status SetAside(const std::string& job_dir, const std::string& dir, const std::string& name,
                      const std::string& why, const Log& log, bool* moved) {
  const std::string file = absl::StrCat(dir, "/", name);
  const std::string aside = absl::StrFormat("%s/abandoned-%s-%s-%d", job_dir, fs::path(dir).filename().string(), name,
                                            absl::ToUnixNanos(absl::Now()));
  if (rename(file.c_str(), aside.c_str()) == 0) {
    *moved = true;
    log(absl::StrCat("set aside ", file, " (", why, ") as ", aside));
    return absl::OkStatus();
  }
  if (const int error = errno; error != ENOENT) {
    return ErrnoStatus(error, absl::StrCat("cannot set aside ", file, " (", why, "; move it away) as ", aside));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status SetAsideOwnNewerParts(const std::string& root, const v1::CreateJobRequest& spec, uint64_t step,
                                   const Log& log) {
  const std::string job_dir = JobDirectory(root, spec.job());
  const std::string own = PartName(spec);
  const std::string why = absl::StrCat("a part of another run: this server runs job '", spec.job(), "' on from step ", step);
  bool moved = false;
  absl::Status status;
  std::error_code ec;
  for (uint64_t t : StepsNewestFirst(job_dir)) {
    if (t <= step) break;
    const std::string dir = StepDirectory(root, spec.job(), t);
    if (fs::exists(absl::StrCat(dir, "/", kCommitName), ec)) continue;  // SetAsideNewerSteps' (restore_step)
    status = SetAside(job_dir, dir, own, why, log, &moved);
    if (!status.ok()) break;
    // A writer of that run that died left its temporary file; only a write
    // of the same step would remove it, and the new run may never write it.
    RemoveTemporaries(dir, own);
  }
  // What was moved stays moved, whatever failed after it.
  if (moved) {
    const absl::Status synced = FsyncDirectory(job_dir);
    if (status.ok()) status = synced;
  }
  return status;
}

absl::Status SetAsideStepOfOldValues(const std::string& root, const v1::CreateJobRequest& spec, uint64_t step,
                                     const Log& log) {
  const std::string job_dir = JobDirectory(root, spec.job());
  const std::string dir = StepDirectory(root, spec.job(), step);
  const std::string why = absl::StrCat("initial values written since changed job '", spec.job(), "' at step ", step);
  bool moved = false;
  // The marker first: with it gone the step is never loaded, and a crash
  // before the part follows leaves a torn step, not a COMMIT that lists a
  // part no longer there.
  absl::Status status = SetAside(job_dir, dir, kCommitName, why, log, &moved);
  if (status.ok()) status = SetAside(job_dir, dir, PartName(spec), why, log, &moved);
  if (moved) {
    const absl::Status synced = FsyncDirectory(job_dir);
    if (status.ok()) status = synced;
    const absl::Status step_synced = FsyncDirectory(dir);
    if (status.ok()) status = step_synced;
  }
  return status;
}

}  // namespace shardopt::checkpoint
