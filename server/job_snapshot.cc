#include "server/job_snapshot.h"

#include <algorithm>
#include <optional>
#include <string>
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

absl::StatusOr<std::unique_ptr<checkpoint::PartWriter>> Snapshot(const Job& job, const std::string& root) {
  if (job.uninitialized_shards > 0) {
    return absl::FailedPreconditionError(absl::StrCat("job '", job.name(), "' has shards without initial values; ",
                                                      "nothing to checkpoint before Init completes"));
  }
  v1::PartManifest m;
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
  std::vector<v1::DType> dtypes;
  for (const v1::ShardSection& section : m.shards()) dtypes.push_back(section.dtype());
  SHARDOPT_ASSIGN_OR_RETURN(auto writer, checkpoint::PartWriter::Open(root, std::move(m)));
  // In slices, so that the copy stays in cache on its way to the writer.
  constexpr uint64_t kSlice = 1 << 18;
  std::vector<float> values(kSlice);
  std::string bytes;
  for (size_t si = 0; si < job.shards.size(); ++si) {
    for (checkpoint::Array a : checkpoint::kArrays) {
      for (uint64_t at = 0; at < job.shards[si].length; at += kSlice) {
        const uint64_t n = std::min(kSlice, job.shards[si].length - at);
        // Read as fp32, which is exact for both precisions.
        SHARDOPT_RETURN_IF_ERROR(
            job.state->ReadState(static_cast<uint32_t>(si), KindOf(a), at, n, DType::kFp32, values.data()));
        const std::string_view encoded = checkpoint::EncodeArray(values.data(), n, dtypes[si], &bytes);
        writer->Append(encoded.data(), encoded.size());
      }
    }
  }
  return writer;
}

namespace {

// Writes a part's data, as it streams in, into the job's state: each piece
// is cut at the arrays' boundaries, and an element split between two pieces
// waits in `carry_` for its other bytes.
class StateSink {
 public:
  StateSink(const v1::PartManifest& m, Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu)
      : m_(m), job_(job), sections_(checkpoint::SectionOffsets(m)) {}

  absl::Status Take(uint64_t offset, const char* p, size_t n) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    while (n > 0) {
      while (shard_ + 1 < sections_.size() && offset >= sections_[shard_ + 1]) ++shard_;
      if (shard_ + 1 >= sections_.size()) return absl::DataLossError("a checkpoint part has more data than its manifest");
      const int s = static_cast<int>(shard_);
      const uint64_t array_bytes = checkpoint::ArrayBytes(m_, s);
      const uint64_t in_section = offset - sections_[shard_];
      const auto array = static_cast<checkpoint::Array>(in_section / array_bytes);
      const uint64_t in_array = in_section % array_bytes;
      const DType dtype = m_.shards(s).dtype() == v1::BF16 ? DType::kBf16 : DType::kFp32;
      const uint64_t esize = DTypeSize(dtype);
      const uint64_t take = std::min<uint64_t>(n, array_bytes - in_array);
      const char* from = p;
      uint64_t first = in_array / esize, count = 0, used = 0;
      if (!carry_.empty() || in_array % esize != 0) {  // finish the split element
        const size_t need = std::min<size_t>(esize - carry_.size(), take);
        carry_.append(p, need);
        used = need;
        if (carry_.size() == esize) {
          SHARDOPT_RETURN_IF_ERROR(Write(s, array, (in_array + need) / esize - 1, dtype, carry_.data(), 1));
          carry_.clear();
        }
        from = p + used;
        first = (in_array + used) / esize;
      }
      count = (take - used) / esize;
      if (count > 0) SHARDOPT_RETURN_IF_ERROR(Write(s, array, first, dtype, from, count));
      used += count * esize;
      carry_.append(p + used, take - used);  // the start of an element that the next piece ends
      offset += take;
      p += take;
      n -= take;
    }
    return absl::OkStatus();
  }

 private:
  absl::Status Write(int s, checkpoint::Array a, uint64_t first, DType dtype, const char* data, uint64_t count)
      ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return job_.state->WriteState(static_cast<uint32_t>(s), KindOf(a), first, dtype, data, count);
  }

  const v1::PartManifest& m_;
  Job& job_;
  const std::vector<uint64_t> sections_;
  size_t shard_ = 0;
  std::string carry_;
};

}  // namespace

absl::Status Restore(const std::string& root, uint64_t step, const checkpoint::Log& log, Job& job) {
  v1::PartManifest layout;
  std::optional<StateSink> sink;
  SHARDOPT_ASSIGN_OR_RETURN(
      auto m, checkpoint::LoadInto(
                  root, job.spec, step, log,
                  [&](const v1::PartManifest& manifest) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                    layout = manifest;
                    sink.emplace(layout, job);
                    return absl::OkStatus();
                  },
                  [&](uint64_t offset, const char* bytes, size_t n) { return sink->Take(offset, bytes, n); }));
  for (size_t si = 0; si < job.shards.size(); ++si) {
    job.adam_steps[si] = m.shards(static_cast<int>(si)).adam_step();
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
