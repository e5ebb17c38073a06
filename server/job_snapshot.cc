#include "server/job_snapshot.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace shardopt {
namespace {

StateKind KindOf(checkpoint::Array a) {
  switch (a) {
    case checkpoint::Array::kMaster: return StateKind::kMaster;
    case checkpoint::Array::kExpAvg: return StateKind::kExpAvg;
    case checkpoint::Array::kExpAvgSq: return StateKind::kExpAvgSq;
  }
  return StateKind::kMaster;
}

}  // namespace

absl::StatusOr<checkpoint::Part> Snapshot(const Job& job) {
  if (job.uninitialized_shards > 0) {
    return absl::FailedPreconditionError(absl::StrCat("job '", job.name(), "' has shards without initial values; ",
                                                      "nothing to checkpoint before Init completes"));
  }
  checkpoint::Part part;
  v1::PartManifest& m = part.manifest;
  *m.mutable_spec() = job.spec;
  m.set_step(job.step);
  v1::AppliedCommit* applied = m.mutable_applied();
  applied->set_step(job.step);
  applied->set_lr(job.applied.lr);
  applied->set_gscale(job.applied.gscale);
  applied->set_skip(job.applied.skip);
  for (double lr : job.applied.group_lr) applied->add_group_lr(lr);
  m.set_sealed_step(job.sealed_step);
  m.set_sealed_sum_squares(job.sealed_stats.sum_squares);
  m.set_sealed_nonfinite(job.sealed_stats.nonfinite);
  for (size_t si = 0; si < job.shards.size(); ++si) {
    v1::ShardSection* section = m.add_shards();
    section->set_adam_step(job.adam_steps[si]);
    section->set_dtype(job.state->held_precision(static_cast<uint32_t>(si)) == Precision::kBf16 ? v1::BF16 : v1::FP32);
  }
  part.data.reserve(checkpoint::SectionOffsets(m).back());
  std::vector<float> values;
  for (size_t si = 0; si < job.shards.size(); ++si) {
    values.resize(job.shards[si].length);
    for (checkpoint::Array a : checkpoint::kArrays) {
      // Read as fp32, which is exact for both precisions.
      SHARDOPT_RETURN_IF_ERROR(job.state->ReadState(static_cast<uint32_t>(si), KindOf(a), 0, values.size(), DType::kFp32, values.data()));
      checkpoint::AppendArray(&part.data, values.data(), values.size(), m.shards(static_cast<int>(si)).dtype());
    }
  }
  return part;
}

absl::Status Restore(const checkpoint::Part& part, Job& job) {
  const v1::PartManifest& m = part.manifest;
  const std::vector<uint64_t> sections = checkpoint::SectionOffsets(m);
  for (size_t si = 0; si < job.shards.size(); ++si) {
    const int s = static_cast<int>(si);
    const DType dtype = m.shards(s).dtype() == v1::BF16 ? DType::kBf16 : DType::kFp32;
    for (checkpoint::Array a : checkpoint::kArrays) {
      SHARDOPT_RETURN_IF_ERROR(job.state->WriteState(static_cast<uint32_t>(si), KindOf(a), 0, dtype, part.data.data() + checkpoint::ArrayOffset(sections, m, s, a), job.shards[si].length));
    }
    job.adam_steps[si] = m.shards(s).adam_step();
    job.init_cover[si].Add(0, job.shards[si].length);
  }
  job.uninitialized_shards = 0;
  job.step = m.step();
  job.applied = {m.applied().lr(), m.applied().gscale(), m.applied().skip(),
                 {m.applied().group_lr().begin(), m.applied().group_lr().end()}};
  job.sealed_step = m.sealed_step();
  job.sealed_stats = {m.sealed_sum_squares(), m.sealed_nonfinite()};
  return absl::OkStatus();
}

}  // namespace shardopt
