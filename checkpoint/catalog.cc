#include "checkpoint/catalog.h"

#include <algorithm>
#include <filesystem>
#include <map>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "checkpoint/crc32c.h"
#include "checkpoint/direct_io.h"
#include "checkpoint/files.h"
#include "base/report_lines.h"
#include "google/protobuf/util/message_differencer.h"
#include "rpc/tensor_shapes.h"

namespace shardopt::checkpoint {
namespace {

namespace fs = std::filesystem;

// The fields that make a job what it is; the placement and the barrier's
// deadline may change across a restore.
v1::CreateJobRequest Identity(const v1::CreateJobRequest& spec) {
  v1::CreateJobRequest id = spec;
  id.clear_shards();
  id.clear_barrier_timeout_ms();
  id.clear_restore_step();
  id.clear_rank();
  for (v1::Group& g : *id.mutable_groups()) g.clear_name();  // for messages only
  return id;
}

// The marker's parts, with their manifests checked against it.
absl::StatusOr<std::vector<PartHead>> ReadCommitted(const std::string& dir, const v1::CommitMarker& marker) {
  std::vector<PartHead> parts;
  for (const v1::PartRef& ref : marker.parts()) {
    auto head = ReadPartHead(absl::StrCat(dir, "/", ref.file()));
    if (!head.ok()) {
      return head.status().code() == absl::StatusCode::kNotFound
                 ? absl::DataLossError(absl::StrCat("COMMIT lists a missing part: ", head.status().message()))
                 : head.status();
    }
    if (head->file_bytes != ref.bytes() || head->data_crc != ref.data_crc32c() ||
        head->manifest.step() != marker.step()) {
      return absl::DataLossError(absl::StrCat(
          head->path, " is not the part COMMIT recorded (", head->file_bytes, " bytes, step ", head->manifest.step(),
          ", data crc32c ", absl::Hex(head->data_crc, absl::kZeroPad8), "; COMMIT says ", ref.bytes(), " bytes, step ",
          marker.step(), ", data crc32c ", absl::Hex(ref.data_crc32c(), absl::kZeroPad8), ")"));
    }
    parts.push_back(*std::move(head));
  }
  if (parts.empty()) return absl::DataLossError(absl::StrCat(dir, "/COMMIT lists no parts"));
  for (const PartHead& p : parts) {
    SHARDOPT_RETURN_IF_ERROR(SameJob(parts.front().manifest.spec(), p.manifest.spec(), p.path, "the step's first part's -> this part's"));
  }
  SHARDOPT_ASSIGN_OR_RETURN(auto tiles, Tiles(parts));
  if (!tiles) return absl::DataLossError(absl::StrCat(dir, ": the parts COMMIT lists do not cover every tensor"));
  return parts;
}

}  // namespace

absl::Status SameJob(const v1::CreateJobRequest& a, const v1::CreateJobRequest& b, const std::string& where,
                     absl::string_view sides) {
  std::string diff;
  google::protobuf::util::MessageDifferencer differ;
  differ.ReportDifferencesToString(&diff);
  // A field at proto3's default is absent: compared and shown as 0, not
  // as "added" with one side's value alone.
  differ.set_message_field_comparison(google::protobuf::util::MessageDifferencer::EQUIVALENT);
  CompareOnlyWhereBothSayIt(&differ);
  differ.set_report_ignores(false);
  if (!differ.Compare(Identity(a), Identity(b))) {
    return absl::FailedPreconditionError(absl::StrCat(
        where, " holds job '", b.job(), "' with another configuration (", sides, ": ", OneLineReport(diff), "); ",
        OtherTrainersPerRank(a, b)
            ? "every node of a job must have the same number of local ranks: attach with the number it was made with"
            : "move the checkpoint away or use another job name"));
  }
  return absl::OkStatus();
}

bool SameShards(const v1::CreateJobRequest& a, const v1::CreateJobRequest& b) {
  if (a.shards_size() != b.shards_size()) return false;
  for (int i = 0; i < a.shards_size(); ++i) {
    if (!google::protobuf::util::MessageDifferencer::Equals(a.shards(i), b.shards(i))) return false;
  }
  return true;
}

int TensorIndex(const v1::CreateJobRequest& spec, const std::string& name) {
  for (int i = 0; i < spec.tensors_size(); ++i) {
    if (spec.tensors(i).name() == name) return i;
  }
  return -1;
}

uint64_t DataBytes(const v1::PartManifest& m) { return SectionOffsets(m).back(); }


absl::StatusOr<PartHead> ReadPartHead(const std::string& path) {
  PartHead h;
  h.path = path;
  SHARDOPT_ASSIGN_OR_RETURN(auto offset, ReadFrame(path, &h.manifest));
  const uint32_t alignment = h.manifest.array_alignment();
  if (alignment != 0 && alignment != kDirectAlignment) {
    return absl::DataLossError(absl::StrCat(path, ": the manifest aligns its arrays to ", alignment,
                                            " bytes; a part aligns them to ", kDirectAlignment, " or not at all"));
  }
  h.data_offset = AlignUp(offset, alignment);
  // The frame's padding up to the data: zeros, as written. No crc32c
  // covers it, so it is checked here; anything else is not a part this
  // build wrote.
  if (h.data_offset > offset) {
    SHARDOPT_ASSIGN_OR_RETURN(auto padding, ReadRange(path, offset, h.data_offset - offset));
    if (padding.find_first_not_of('\0') != std::string::npos) {
      return absl::DataLossError(absl::StrCat(path, ": the padding between its manifest and its data is not zeros"));
    }
  }
  if (h.manifest.shards_size() != h.manifest.spec().shards_size()) {
    return absl::DataLossError(absl::StrCat(path, ": manifest has ", h.manifest.shards_size(), " sections for ",
                                            h.manifest.spec().shards_size(), " shards"));
  }
  // The manifest is data too: before its sizes and ranges place anything,
  // each range must lie in its tensor, each section be FP32 or BF16, and
  // the sizes add up without wrapping. A corrupt or crafted file is then
  // DATA_LOSS, never a read outside it.
  const v1::CreateJobRequest& spec = h.manifest.spec();
  for (const v1::TensorSpec& t : spec.tensors()) {
    if (t.group() >= static_cast<uint32_t>(spec.groups_size())) {
      return absl::DataLossError(absl::StrCat(path, ": tensor '", t.name(), "' is in group ", t.group(), " of ",
                                              spec.groups_size()));
    }
  }
  uint64_t data_bytes = 0;
  for (int s = 0; s < spec.shards_size(); ++s) {
    const v1::ShardRange& r = spec.shards(s);
    const int t = TensorIndex(spec, r.tensor());
    const v1::DType dtype = h.manifest.shards(s).dtype();
    if (t < 0 || r.offset() > spec.tensors(t).numel() || r.length() > spec.tensors(t).numel() - r.offset() ||
        (dtype != v1::FP32 && dtype != v1::BF16)) {
      return absl::DataLossError(absl::StrCat(path, ": section ", s, " holds elements ", r.offset(), " + ", r.length(),
                                              " of tensor '", r.tensor(), "' as ", v1::DType_Name(dtype),
                                              ", which the manifest's job does not have"));
    }
    // SectionBytes, checked: master, m and v, each of the section's dtype,
    // each padded to the alignment. Lengths are at most 2^40 elements, so
    // an array's padding cannot wrap once its bytes did not.
    uint64_t array = 0, section = 0;
    if (__builtin_mul_overflow(r.length(), ElementBytes(dtype), &array) || array > (uint64_t{1} << 62) ||
        __builtin_mul_overflow(AlignUp(array, alignment), 3, &section) ||
        __builtin_add_overflow(data_bytes, section, &data_bytes)) {
      return absl::DataLossError(absl::StrCat(path, ": the manifest's sections add up past 2^64 bytes"));
    }
  }
  SHARDOPT_ASSIGN_OR_RETURN(auto size, FileSize(path));
  h.file_bytes = size;
  uint64_t expected = 0;
  if (__builtin_add_overflow(h.data_offset, data_bytes + 4, &expected) || data_bytes + 4 < data_bytes) {
    return absl::DataLossError(absl::StrCat(path, ": the manifest's sections add up past 2^64 bytes"));
  }
  if (h.file_bytes != expected) {
    return absl::DataLossError(absl::StrCat(path, " is ", h.file_bytes, " bytes; its manifest says ", expected,
                                            h.file_bytes < expected ? " (truncated)" : ""));
  }
  SHARDOPT_ASSIGN_OR_RETURN(auto trailer, ReadRange(path, h.file_bytes - 4, 4));
  h.data_crc = static_cast<uint32_t>(GetLE(trailer.data(), 4));
  return h;
}

// The parts' shard ranges of each tensor must tile it: sorted by offset, each
// begins where the previous ended. Returns whether they cover every tensor.
absl::StatusOr<bool> Tiles(const std::vector<PartHead>& parts) {
  const v1::CreateJobRequest& spec = parts.front().manifest.spec();
  std::vector<std::map<uint64_t, std::pair<uint64_t, const PartHead*>>> ranges(spec.tensors_size());
  for (const PartHead& p : parts) {
    for (const v1::ShardRange& s : p.manifest.spec().shards()) {
      const int t = TensorIndex(spec, s.tensor());
      if (t < 0) return absl::DataLossError(absl::StrCat(p.path, " names unknown tensor '", s.tensor(), "'"));
      auto [it, fresh] = ranges[t].emplace(s.offset(), std::make_pair(s.length(), &p));
      if (!fresh) {
        return absl::FailedPreconditionError(absl::StrCat(p.path, " and ", it->second.second->path, " both hold tensor '",
                                                          s.tensor(), "' from element ", s.offset(),
                                                          ": parts of two placements are mixed in one step"));
      }
    }
  }
  bool complete = true;
  for (int t = 0; t < spec.tensors_size(); ++t) {
    uint64_t end = 0;
    for (const auto& [offset, r] : ranges[t]) {
      if (offset < end) {
        return absl::FailedPreconditionError(absl::StrCat(r.second->path, " overlaps another part in tensor '",
                                                          spec.tensors(t).name(), "' at element ", offset));
      }
      if (offset > end) complete = false;
      end = offset + r.first;
    }
    if (end != spec.tensors(t).numel()) complete = false;
  }
  return complete;
}

std::vector<uint64_t> StepsNewestFirst(const std::string& job_dir) {
  std::vector<uint64_t> steps;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(job_dir, ec)) {
    const std::string name = entry.path().filename().string();
    uint64_t step;
    // A file of a step's name is no step: the restore and the setting aside
    // of torn steps pass over it alike (the latter failed on it for good).
    if (!entry.is_directory(ec)) continue;
    if (name.size() == 25 && name.rfind("step-", 0) == 0 && absl::SimpleAtoi(name.substr(5), &step)) {
      steps.push_back(step);
    }
  }
  std::sort(steps.rbegin(), steps.rend());
  return steps;
}

// Streams a part's data to `sink`, checking its crc32c as it goes; the
// mismatch, if any, is known after the last piece.
absl::Status StreamPartData(const PartHead& p, const DataSink& sink, const DirectDestination& direct) {
  uint32_t crc = 0;
  uint64_t at = 0;
  const absl::Status read = ReadSequential(
      p.path, p.data_offset, p.file_bytes - 4 - p.data_offset,
      [&](const char* bytes, size_t n) {
        crc = Crc32c(bytes, n, crc);
        const uint64_t offset = at;
        at += n;
        return sink(offset, bytes, n);
      },
      direct);
  // The part was there when its head was read: gone now, the checkpoint is
  // damaged, not absent (NOT_FOUND would let a restore start the job afresh).
  if (read.code() == absl::StatusCode::kNotFound) {
    return absl::DataLossError(absl::StrCat(p.path, " vanished while it was read: ", read.message()));
  }
  SHARDOPT_RETURN_IF_ERROR(read);
  if (crc != p.data_crc) {
    return absl::DataLossError(absl::StrCat(p.path, ": data checksum mismatch (crc32c); not loading it"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadPartData(const PartHead& p) {
  std::string data(p.file_bytes - 4 - p.data_offset, '\0');
  SHARDOPT_RETURN_IF_ERROR(StreamPartData(p, [&](uint64_t offset, const char* bytes, size_t n) {
    std::memcpy(data.data() + offset, bytes, n);
    return absl::OkStatus();
  }));
  return data;
}

std::string PartName(const v1::CreateJobRequest& spec) {
  const v1::ShardRange& first = spec.shards(0);
  return absl::StrCat("part-", TensorIndex(spec, first.tensor()), "-", first.offset(), ".bin");
}

bool IsPartName(const std::string& file) {
  return file.rfind("part-", 0) == 0 && file.size() > 4 && file.compare(file.size() - 4, 4, ".bin") == 0;
}

// Parts of a step that overlap this server's were left by a torn attempt with
// another placement (the peers of one placement never overlap); they would
// keep the step from ever tiling, and nothing complete refers to them.
void RemoveTemporaries(const std::string& dir, const std::string& part) {
  const std::string prefix = part + ".tmp.";
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (entry.path().filename().string().rfind(prefix, 0) == 0) fs::remove(entry.path(), ec);
  }
}

void RemoveOverlappingParts(const std::string& dir, const std::string& own, const v1::CreateJobRequest& spec) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string file = entry.path().filename().string();
    if (!IsPartName(file) || file == own) continue;
    auto head = ReadPartHead(entry.path().string());
    if (!head.ok()) continue;  // WritePart's check of every part reports it
    for (const v1::ShardRange& theirs : head->manifest.spec().shards()) {
      for (const v1::ShardRange& ours : spec.shards()) {
        if (theirs.tensor() == ours.tensor() && theirs.offset() < ours.offset() + ours.length() &&
            ours.offset() < theirs.offset() + theirs.length()) {
          fs::remove(entry.path(), ec);
        }
      }
    }
  }
}


// The complete checkpoint of `step`, or the newest one when step is 0.
absl::StatusOr<Committed> FindCommitted(const std::string& root, const std::string& job, uint64_t step,
                                        const Log& log) {
  const std::vector<uint64_t> steps = step > 0 ? std::vector<uint64_t>{step} : StepsNewestFirst(JobDirectory(root, job));
  for (uint64_t t : steps) {
    Committed c;
    c.dir = StepDirectory(root, job, t);
    std::error_code ec;
    if (!fs::is_directory(c.dir, ec)) {
      // Listed, then gone: a peer pruned it meanwhile; an older one may do.
      if (step == 0) continue;
      return absl::NotFoundError(absl::StrCat("no checkpoint of job '", job, "' step ", t, " in ", root));
    }
    auto read = ReadFrame(absl::StrCat(c.dir, "/", kCommitName), &c.marker);
    if (read.status().code() == absl::StatusCode::kNotFound) {
      const std::string why = absl::StrCat("checkpoint ", c.dir, " is torn (no COMMIT marker: not every part was written)");
      if (step > 0) return absl::NotFoundError(why);
      log(absl::StrCat(why, "; trying an older one"));
      continue;
    }
    if (!read.ok()) return read.status();
    if (c.marker.job() != job || c.marker.step() != t) {
      return absl::DataLossError(absl::StrCat(c.dir, "/COMMIT is for job '", c.marker.job(), "' step ", c.marker.step()));
    }
    SHARDOPT_ASSIGN_OR_RETURN(auto parts, ReadCommitted(c.dir, c.marker));
    c.parts = std::move(parts);
    return c;
  }
  return absl::NotFoundError(absl::StrCat("no complete checkpoint of job '", job, "' in ", root));
}

uint32_t TrainersPerRank(const Committed& committed) {
  for (const PartHead& part : committed.parts) {
    if (const uint32_t g = part.manifest.spec().trainers_per_rank(); g != 0) return g;
  }
  return 0;
}

}  // namespace shardopt::checkpoint
