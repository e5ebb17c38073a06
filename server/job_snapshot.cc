#include "server/job_snapshot.h"

#include <algorithm>
#include <atomic>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "server/messages.h"

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

namespace {

// Streams the state into the writer, in slices so that each copy stays in
// cache on its way to the disk. Each slice is located, or read out, under
// the lock; the append, which may wait for the disk, is made without it.
// An array the host holds as fp32 (so its section is FP32) is appended from
// where it lies, which nothing writes while the job counts this snapshot;
// the rest is read out as fp32 (exact for both precisions) and encoded.
absl::Status StreamState(Job& job, const std::vector<v1::DType>& dtypes, checkpoint::PartWriter& writer,
                         const std::function<void()>& after_slice) {
  constexpr uint64_t kSlice = 1 << 18;
  std::vector<float> values(kSlice);
  std::string bytes;
  for (size_t si = 0; si < job.shards.size(); ++si) {
    for (checkpoint::Array a : checkpoint::kArrays) {
      for (uint64_t at = 0; at < job.shards[si].length; at += kSlice) {
        const uint64_t n = std::min(kSlice, job.shards[si].length - at);
        std::string_view slice;
        {
          absl::MutexLock lock(&job.mu);
          SHARDOPT_RETURN_IF_ERROR(job.CheckNotDropped());
          if (const char* host = job.state->HostFp32State(static_cast<uint32_t>(si), KindOf(a))) {
            slice = std::string_view(host + at * 4, n * 4);
          } else {
            SHARDOPT_RETURN_IF_ERROR(
                job.state->ReadState(static_cast<uint32_t>(si), KindOf(a), at, n, DType::kFp32, values.data()));
            slice = checkpoint::EncodeArray(values.data(), n, dtypes[si], &bytes);
          }
        }
        writer.Append(slice.data(), slice.size());
        if (after_slice) after_slice();
        if (!writer.wants_data()) return absl::OkStatus();  // a write failed: Finish says so
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<checkpoint::PartWriter>> Snapshot(Job& job, const std::string& root, uint64_t step,
                                                                 absl::Time deadline, uint32_t array_alignment,
                                                                 const std::function<absl::Status()>& began,
                                                                 const std::function<void()>& after_slice) {
  v1::PartManifest m;
  std::vector<v1::DType> dtypes;
  bool written = false;
  std::optional<uint64_t> read_from_life;  // PartWriter::Open
  bool changed_since_restore = false;
  {
    absl::MutexLock lock(&job.mu);
    if (!job.AwaitWholeStep(deadline)) {
      return absl::DeadlineExceededError(absl::StrCat("job '", job.name(), "' is still applying step ", job.step + 1,
                                                      ": its committer has not read all the params"));
    }
    SHARDOPT_RETURN_IF_ERROR(job.CheckNotDropped());
    if (!job.failed.ok()) return job.failed;
    if (step != job.step) {
      return absl::FailedPreconditionError(
          absl::StrCat("job '", job.name(), "' is at step ", job.step, "; cannot checkpoint step ", step));
    }
    if (job.uninitialized_shards > 0) {
      return absl::FailedPreconditionError(absl::StrCat("job '", job.name(), "' has shards without initial values; ",
                                                        "nothing to checkpoint before Init completes"));
    }
    *m.mutable_spec() = job.spec;
    m.set_step(job.step);
    m.set_incarnation(job.incarnation);
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
      section->set_dtype(job.state->held_precision(static_cast<uint32_t>(si)) == Precision::kBf16 ? v1::BF16
                                                                                                  : v1::FP32);
      dtypes.push_back(section->dtype());
    }
    written = job.part_written == job.step;
    // A part this server wrote of the step since is the state's (initial
    // values written after it set it aside: JobStore::TryInit).
    if (!written && job.restored_from && job.restored_from->step == job.step) {
      if (job.restored_from->changed) {
        changed_since_restore = true;
      } else {
        read_from_life = job.restored_from->life;
      }
    }
    ++job.snapshots;
  }
  // From here until the state has streamed out, nothing writes it; the
  // file system's work and the stream are done without the job's lock. On
  // an error the count goes before the writer, whose thread may still be
  // writing what it queued.
  std::unique_ptr<checkpoint::PartWriter> writer;
  absl::Cleanup uncount = [&job] {
    absl::MutexLock lock(&job.mu);
    --job.snapshots;
    job.Notify();
  };
  SHARDOPT_RETURN_IF_ERROR(began());
  if (changed_since_restore && checkpoint::StepCommitted(root, job.name(), m.step())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "step ", m.step(), " of job ", Quote(job.name()), " is complete in ",
        checkpoint::StepDirectory(root, job.name(), m.step()), " with the state this job was restored from, and ",
        "initial values written since have changed it: they are in no checkpoint, and this one would not hold them; "
        "nothing was written. Step on (the next step's checkpoint holds them), or move that directory aside and "
        "checkpoint again"));
  }
  SHARDOPT_ASSIGN_OR_RETURN(writer, checkpoint::PartWriter::Open(root, std::move(m), written, array_alignment,
                                                                         read_from_life));
  if (writer->wants_data()) SHARDOPT_RETURN_IF_ERROR(StreamState(job, dtypes, *writer, after_slice));
  return writer;
}

namespace {

// Writes a part's data, as it streams in, into the job's state, skipping
// the arrays' padding. In a version-1 part a piece may end inside an
// element (the reader cuts at multiples of 8 MiB, and an array may start at
// any even offset after a bf16 one): those bytes wait in `partial_` for the
// rest of their element. Bytes read straight into place are left there.
class StateSink {
 public:
  StateSink(const v1::PartManifest& m, Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu)
      : m_(m), job_(job), sections_(checkpoint::SectionOffsets(m)) {}

  // A run's pieces come in order, contiguous (the whole data is one run on
  // a plain restart); runs and arrays end on whole elements, so a split
  // element never spans two (checkpoint::LoadInto).
  absl::Status Take(uint64_t offset, const char* p, size_t n) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    while (n > 0) {
      SHARDOPT_ASSIGN_OR_RETURN(const Location at, Locate(offset));
      if (at.in_array >= at.array_bytes) {  // an array's padding (format version 2): zeros, nothing to write
        const size_t skip = static_cast<size_t>(std::min<uint64_t>(n, at.array_stride - at.in_array));
        offset += skip;
        p += skip;
        n -= skip;
        continue;
      }
      const uint64_t esize = DTypeSize(at.dtype);
      const size_t take = static_cast<size_t>(std::min<uint64_t>(n, at.array_bytes - at.in_array));
      uint64_t element = at.in_array / esize;
      size_t used = 0;
      if (!partial_.empty()) {
        used = std::min<size_t>(take, esize - partial_.size());
        partial_.append(p, used);
        if (partial_.size() < esize) return absl::OkStatus();  // the piece ended first
        SHARDOPT_RETURN_IF_ERROR(Write(at, element++, partial_.data(), 1));
        partial_.clear();
      }
      const uint64_t whole = (take - used) / esize;
      if (whole > 0) SHARDOPT_RETURN_IF_ERROR(Write(at, element, p + used, whole));
      used += whole * esize;
      partial_.assign(p + used, take - used);
      offset += take;
      p += take;
      n -= take;
    }
    return absl::OkStatus();
  }

 private:
  struct Location {
    int shard;
    checkpoint::Array array;
    uint64_t array_bytes, array_stride, in_array;  // in_array past array_bytes: in its padding
    DType dtype;
  };
  absl::StatusOr<Location> Locate(uint64_t offset) const {
    const auto next = std::upper_bound(sections_.begin(), sections_.end(), offset);
    if (next == sections_.begin() || next == sections_.end()) {
      return absl::DataLossError("a checkpoint part has more data than its manifest");
    }
    Location at;
    at.shard = static_cast<int>(next - sections_.begin() - 1);
    at.array_bytes = checkpoint::ArrayBytes(m_, at.shard);
    at.array_stride = checkpoint::ArrayStride(m_, at.shard);
    const uint64_t in_section = offset - sections_[at.shard];
    at.array = static_cast<checkpoint::Array>(in_section / at.array_stride);
    at.in_array = in_section % at.array_stride;
    at.dtype = m_.shards(at.shard).dtype() == v1::BF16 ? DType::kBf16 : DType::kFp32;
    return at;
  }

  absl::Status Write(const Location& at, uint64_t element, const char* bytes, uint64_t count)
      ABSL_NO_THREAD_SAFETY_ANALYSIS {
    return job_.state->WriteState(static_cast<uint32_t>(at.shard), KindOf(at.array), element, at.dtype, bytes, count);
  }

  const v1::PartManifest& m_;
  Job& job_;
  const std::vector<uint64_t> sections_;
  std::string partial_;  // the first bytes of an element the last piece split
};

// Faults the state's memory in, on a thread of its own, in the order the
// data comes, while the disk reads: fresh memory cost this VM about as much
// to fault in as the disk took to read into it (docs/measurements.md,
// "Checkpoint write and restore"), and the
// sink's copies then find it mapped. It runs until done or destroyed.
class Prefaulter {
 public:
  // `m` and `state` outlive it (Restore destroys it first).
  Prefaulter(const v1::PartManifest& m, const JobState& state) : thread_([this, &m, &state] { Run(m, state); }) {}
  ~Prefaulter() {
    stop_ = true;
    thread_.join();
  }

 private:
  void Run(const v1::PartManifest& m, const JobState& state) {
    for (int si = 0; si < m.shards_size(); ++si) {
      const uint64_t length = m.spec().shards(si).length();
      const uint64_t step = checkpoint::kDirectChunkBytes / checkpoint::ElementBytes(m.shards(si).dtype());
      for (checkpoint::Array a : checkpoint::kArrays) {
        for (uint64_t at = 0; at < length && !stop_; at += step) {
          const uint64_t n = std::min(step, length - at);
          state.Prefault(static_cast<uint32_t>(si), KindOf(a), at, n);
          // A write of the master writes the bf16 params from it.
          if (a == checkpoint::Array::kMaster) state.Prefault(static_cast<uint32_t>(si), StateKind::kParamBf16, at, n);
        }
      }
    }
  }

  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// The part's arrays that may be read straight into the state, by where
// they start in the data: those the part pads (format version 2) and the
// host holds as fp32, as the part does, with room for the padding too
// (HostStateRoom). Made once the manifest is known, under the job's lock;
// the reader thread then asks only this (At). The sink finds those bytes
// in place, and WriteState copies nothing.
class DirectArrays {
 public:
  DirectArrays() = default;
  DirectArrays(const v1::PartManifest& m, JobState& state) {
    if (m.array_alignment() == 0) return;
    const std::vector<uint64_t> sections = checkpoint::SectionOffsets(m);
    for (int si = 0; si < m.shards_size(); ++si) {
      if (m.shards(si).dtype() != v1::FP32) continue;
      const uint64_t stride = checkpoint::ArrayStride(m, si);
      for (checkpoint::Array a : checkpoint::kArrays) {
        char* memory = state.HostFp32State(static_cast<uint32_t>(si), KindOf(a));
        if (memory == nullptr || state.HostStateRoom(static_cast<uint32_t>(si), KindOf(a)) < stride) continue;
        arrays_.push_back({checkpoint::ArrayOffset(sections, m, si, a), stride, memory});
      }
    }
  }
  // Where the data's bytes from `at` on go straight to, and how many; else
  // {nullptr, the bytes up to the next array that does} ({nullptr, 0}: none
  // after), so that the buffered pieces before it end there.
  std::pair<char*, uint64_t> At(uint64_t at) const {
    auto next = std::upper_bound(arrays_.begin(), arrays_.end(), at,
                                 [](uint64_t x, const Array& a) { return x < a.offset; });
    if (next != arrays_.begin()) {
      const Array& in = *std::prev(next);
      if (at < in.offset + in.stride) return {in.memory + (at - in.offset), in.offset + in.stride - at};
    }
    return {nullptr, next == arrays_.end() ? 0 : next->offset - at};
  }

 private:
  struct Array {
    uint64_t offset, stride;
    char* memory;
  };
  std::vector<Array> arrays_;  // by offset
};

}  // namespace

absl::Status Restore(const std::string& root, uint64_t step, const checkpoint::Log& log, Job& job,
                     uint64_t own_life) {
  v1::PartManifest layout;
  DirectArrays direct;
  std::optional<StateSink> sink;
  std::optional<Prefaulter> prefault;
  const auto begin = [&](const v1::PartManifest& manifest) ABSL_NO_THREAD_SAFETY_ANALYSIS {
    layout = manifest;
    direct = DirectArrays(layout, *job.state);
    sink.emplace(layout, job);
    prefault.emplace(layout, *job.state);
    return absl::OkStatus();
  };
  const auto take = [&](uint64_t offset, const char* bytes, size_t n) { return sink->Take(offset, bytes, n); };
  const auto at = [&](uint64_t offset) { return direct.At(offset); };
  SHARDOPT_ASSIGN_OR_RETURN(auto m, own_life != 0
                                        ? checkpoint::LoadOwnPart(root, job.spec, step, own_life, begin, take, at)
                                        : checkpoint::LoadInto(root, job.spec, step, log, begin, take, at));
  for (size_t si = 0; si < job.shards.size(); ++si) {
    job.adam_steps[si] = m.shards(static_cast<int>(si)).adam_step();
    job.init_cover[si].Add(0, job.shards[si].length);
  }
  job.uninitialized_shards = 0;
  job.written = true;
  job.step = m.step();
  job.incarnation = m.incarnation();  // 0 from an older part: the store gives it a new one
  // A skip as every skip is recorded, also one an older server wrote with
  // the numbers it was sent: compared with a retry's, they must be alike.
  job.applied = m.applied().skip() ? CommitArgs::Skip()
                                   : CommitArgs{m.applied().lr(), m.applied().gscale(), false,
                                                {m.applied().group_lr().begin(), m.applied().group_lr().end()}};
  // A round sealed after the step (its push done, not yet committed) is
  // not restored, only its sums: without its gradients it can be neither
  // committed nor answered, so the job keeps no sealed step.
  if (m.sealed_step() <= m.step()) {
    job.sealed_step = m.sealed_step();
    job.sealed_stats = {m.sealed_sum_squares(), m.sealed_nonfinite()};
  }
  return absl::OkStatus();
}

}  // namespace shardopt
