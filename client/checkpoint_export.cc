#include "client/checkpoint_export.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "checkpoint/catalog.h"
#include "checkpoint/files.h"
#include "checkpoint/format.h"
#include "kernels/adamw_math.h"
#include "shardopt/safetensors.h"

namespace shardopt {
namespace {

// Whether `out` (through any symlinks) names a place in the checkpoint
// directory `dir`, which the servers own: an export there could replace a
// file of the very checkpoint it reads, another job's checkpoint, or the
// directory's id, without which no server starts on it.
bool InsideTheCheckpointDirectory(const std::string& dir, const std::string& out) {
  // Absolute first: weakly_canonical leaves a relative path whose first
  // part does not exist relative.
  std::error_code dir_ec, out_ec;
  const std::string root =
      std::filesystem::weakly_canonical(std::filesystem::absolute(dir, dir_ec), dir_ec).string();
  const std::filesystem::path target =
      std::filesystem::weakly_canonical(std::filesystem::absolute(out, out_ec), out_ec);
  if (dir_ec || out_ec) return false;
  if (target == root || absl::StartsWith(target.string(), absl::StrCat(root, root.back() == '/' ? "" : "/"))) {
    return true;
  }
  // By another path that is no symlink (a bind mount of the directory): an
  // ancestor of `out` that is the directory itself, by device and inode.
  struct stat r;
  if (stat(root.c_str(), &r) != 0) return false;
  for (std::filesystem::path p = target;; p = p.parent_path()) {
    struct stat st;
    if (stat(p.c_str(), &st) == 0 && st.st_dev == r.st_dev && st.st_ino == r.st_ino) return true;
    if (p == p.parent_path()) return false;
  }
}

}  // namespace

absl::Status ExportCheckpoint(const std::string& dir, uint64_t step, bool bf16, const std::string& job,
                              const std::string& out) {
  const auto log = [](const std::string& line) { std::cerr << "shardopt: " << line << "\n"; };
  if (InsideTheCheckpointDirectory(dir, out)) {
    return absl::InvalidArgumentError(absl::StrCat(
        out, " lies in the checkpoint directory ", dir, ", whose files the servers write and restore (every job's "
        "checkpoints and the directory's id); write it elsewhere"));
  }
  // The steps whose COMMIT is there: a prune takes it first.
  const auto complete = [&] {
    std::vector<uint64_t> steps;
    std::error_code ec;
    for (uint64_t t : checkpoint::StepsNewestFirst(checkpoint::JobDirectory(dir, job))) {
      if (std::filesystem::exists(absl::StrCat(checkpoint::StepDirectory(dir, job, t), "/", checkpoint::kCommitName), ec)) {
        steps.push_back(t);
      }
    }
    return steps;
  };
  absl::StatusOr<checkpoint::WholeJob> at;
  for (int attempt = 1;; ++attempt) {
    const std::vector<uint64_t> before = complete();
    at = checkpoint::LoadWholeJob(dir, job, step, log);
    if (at.ok()) break;
    // The newest step pruned while it was read (a live job's server with
    // --checkpoint_keep): the complete steps there now differ, and the
    // newest one now will do. A damaged checkpoint in a quiet directory
    // fails at once.
    if (step != 0 || attempt == 5 || complete() == before) return at.status();
    log("the job's checkpoints changed while they were read (a server pruned them); reading the newest again");
  }
  const checkpoint::Part& part = at->part;
  std::vector<SafetensorsTensor> tensors;
  const std::vector<uint64_t> sections = checkpoint::SectionOffsets(part.manifest);
  std::vector<float> master;
  for (int s = 0; s < part.manifest.shards_size(); ++s) {
    const uint64_t n = at->spec.shards(s).length();
    master.resize(n);
    checkpoint::DecodeArray(part.data.data() + checkpoint::ArrayOffset(sections, part.manifest, s, checkpoint::Array::kMaster),
                            n, part.manifest.shards(s).dtype(), master.data());
    SafetensorsTensor t{at->spec.shards(s).tensor(), bf16 ? "BF16" : "F32", {n}, {}};
    // The model's shape where the job has one (WholeJob's shards: its tensors).
    if (const auto& dims = at->spec.tensors(s).shape(); !dims.empty()) t.shape.assign(dims.begin(), dims.end());
    t.data.resize(n * (bf16 ? 2 : 4));
    // A NaN master (only the overflow of design.md §3.6 makes one) is
    // written as it is, in either dtype; an import refuses the file.
    const uint64_t not_finite = std::count_if(master.begin(), master.end(), [](float x) { return !std::isfinite(x); });
    if (not_finite > 0) {
      log(absl::StrCat("warning: ", not_finite, " masters of tensor '", t.name,
                       "' are not finite (NaN or infinity): they are exported as they are, and an import refuses "
                       "the file"));
    }
    if (!bf16) {
      std::memcpy(t.data.data(), master.data(), n * 4);
    } else {
      uint64_t overflowed = 0;  // finite masters past bf16's largest finite value
      for (uint64_t i = 0; i < n; ++i) {
        const uint16_t h = math::float_to_bf16(master[i]);
        overflowed += std::isfinite(master[i]) && (h & 0x7fff) == 0x7f80;
        std::memcpy(t.data.data() + 2 * i, &h, 2);
      }
      if (overflowed > 0) {
        log(absl::StrCat("warning: ", overflowed, " finite masters of tensor '", t.name,
                         "' round to infinity in bf16 (from about 3.396e38, past its largest finite value), which an "
                         "import refuses; export them as fp32"));
      }
    }
    tensors.push_back(std::move(t));
  }
  const std::map<std::string, std::string> metadata = {
      {"job", job}, {"step", std::to_string(at->step)}, {"state", "master"}, {"format", "pt"}};
  SHARDOPT_RETURN_IF_ERROR(WriteSafetensors(out, tensors, metadata));
  std::cout << "exported job '" << job << "' step " << at->step << " (" << tensors.size() << " tensors, "
            << (bf16 ? "bf16" : "fp32") << ") to " << out << "\n";
  return absl::OkStatus();
}


}  // namespace shardopt
