#include "checkpoint/format.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <optional>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "checkpoint/catalog.h"
#include "checkpoint/crc32c.h"
#include "checkpoint/files.h"

namespace shardopt::checkpoint {

namespace fs = std::filesystem;

std::string JobDirectoryName(const std::string& job) {
  std::string out;
  for (unsigned char c : job) {
    if (absl::ascii_isalnum(c) || c == '-' || c == '_' || c == '.') {  // not std::isalnum: the locale's
      out.push_back(static_cast<char>(c));
    } else {
      absl::StrAppendFormat(&out, "%%%02X", c);
    }
  }
  return out == "." || out == ".." ? absl::StrCat("%2E", out.substr(1)) : out;
}


uint64_t ArrayBytes(const v1::PartManifest& m, int shard) {
  return m.spec().shards(shard).length() * ElementBytes(m.shards(shard).dtype());
}

std::vector<uint64_t> SectionOffsets(const v1::PartManifest& m) {
  std::vector<uint64_t> offsets(1, 0);
  for (int s = 0; s < m.shards_size(); ++s) offsets.push_back(offsets.back() + SectionBytes(m, s));
  return offsets;
}

std::string_view EncodeArray(const float* values, uint64_t count, v1::DType dtype, std::string* scratch) {
  if (dtype == v1::FP32) return {reinterpret_cast<const char*>(values), count * 4};
  scratch->resize(count * 2);
  for (uint64_t i = 0; i < count; ++i) {
    uint32_t u;
    std::memcpy(&u, &values[i], 4);
    const uint16_t h = static_cast<uint16_t>(u >> 16);  // exact: the value is a bf16 one
    std::memcpy(scratch->data() + 2 * i, &h, 2);
  }
  return *scratch;
}

void DecodeArray(const char* bytes, uint64_t count, v1::DType dtype, float* out) {
  if (dtype == v1::FP32) {
    std::memcpy(out, bytes, count * 4);
    return;
  }
  for (uint64_t i = 0; i < count; ++i) {
    uint16_t h;
    std::memcpy(&h, bytes + 2 * i, 2);
    const uint32_t u = uint32_t{h} << 16;
    std::memcpy(&out[i], &u, 4);
  }
}

std::string JobDirectory(const std::string& root, const std::string& job) {
  return absl::StrCat(root, "/", JobDirectoryName(job));
}

std::string StepDirectory(const std::string& root, const std::string& job, uint64_t step) {
  return absl::StrFormat("%s/step-%020u", JobDirectory(root, job), step);
}

bool StepCommitted(const std::string& root, const std::string& job, uint64_t step) {
  std::error_code ec;
  return fs::exists(absl::StrCat(StepDirectory(root, job, step), "/", kCommitName), ec);
}

absl::StatusOr<std::unique_ptr<PartWriter>> PartWriter::Open(const std::string& root, v1::PartManifest manifest,
                                                             bool written, uint32_t array_alignment,
                                                             std::optional<uint64_t> read_from_life) {
  if (array_alignment != 0 && array_alignment != kDirectAlignment) {
    return absl::InternalError(absl::StrCat("a checkpoint part aligns its arrays to ", kDirectAlignment, " or not"));
  }
  const v1::CreateJobRequest& spec = manifest.spec();
  if (spec.shards_size() == 0 || manifest.shards_size() != spec.shards_size()) {
    return absl::InternalError("a checkpoint part needs shards and a section for each");
  }
  std::unique_ptr<PartWriter> w(new PartWriter());
  w->root_ = root;
  w->result_.directory = StepDirectory(root, spec.job(), manifest.step());
  std::error_code ec;
  fs::create_directories(w->result_.directory, ec);
  if (ec) return ErrnoStatus(ec.value(), absl::StrCat("cannot create ", w->result_.directory));
  // A step's state is unique (the step protocol applies each step once), so
  // a complete checkpoint of it needs nothing more, from any placement; but
  // only of this life of the job. This placement's part written by another
  // life (two servers or runs with one job name in one directory) would
  // otherwise be taken as this one's state. A job restored from this step
  // under a new life holds the state of the parts it was read from: they
  // are its own.
  if (fs::exists(absl::StrCat(w->result_.directory, "/", kCommitName), ec)) {
    // This placement's part of the step, if another life wrote it; where
    // this placement has none there (the step was written by another
    // placement), any part, when none of them is this life's and the state
    // was not read from them (a restore onto another placement reads them
    // all). A run of the name on another placement was answered "complete"
    // with the other run's state on disk (an outside probe).
    std::optional<PartHead> other;
    const auto another = [&](uint64_t life) {
      return life != 0 && manifest.incarnation() != 0 && life != manifest.incarnation() && life != read_from_life;
    };
    if (auto head = ReadPartHead(absl::StrCat(w->result_.directory, "/", PartName(spec)));
        head.ok() && SameShards(head->manifest.spec(), spec)) {
      if (another(head->manifest.incarnation())) other = *std::move(head);
    } else if (!read_from_life) {
      bool ours = false;
      for (const auto& entry : fs::directory_iterator(w->result_.directory, ec)) {
        if (!IsPartName(entry.path().filename().string())) continue;
        auto part = ReadPartHead(entry.path().string());
        if (!part.ok() || part->manifest.incarnation() == 0) continue;
        if (!another(part->manifest.incarnation())) ours = true;
        if (!other) other = *std::move(part);
      }
      if (ours) other.reset();
    }
    if (other) {
      return absl::FailedPreconditionError(absl::StrCat(
          "step ", manifest.step(), " of job ", spec.job(), " is complete in ", w->result_.directory,
          " already, and its part there", SameShards(other->manifest.spec(), spec) ? "" : " (of another placement)",
          " is another life of job ", spec.job(), "'s (incarnation ", other->manifest.incarnation(), ", this one ",
          manifest.incarnation(), "): two servers or runs give one job name and share this --checkpoint_dir; "
          "nothing was written. Give each run its own job name, or each server its own directory"));
    }
    w->result_.complete = true;
    w->manifest_ = std::move(manifest);
    return w;
  }
  w->name_ = PartName(spec);
  RemoveOverlappingParts(w->result_.directory, w->name_, spec);
  if (written) {
    // Kept only if it is this placement's part of this step: a file of the
    // same name may be another placement's, left by a torn attempt.
    auto head = ReadPartHead(absl::StrCat(w->result_.directory, "/", w->name_));
    if (head.ok() && head->manifest.step() == manifest.step() && SameShards(head->manifest.spec(), spec)) {
      w->kept_ = true;
      w->placed_ = true;
      w->manifest_ = std::move(manifest);
      return w;
    }
  }
  // A temporary file of this part left by a writer that died (this server
  // writes one checkpoint of a job at a time) is of no use to anyone.
  RemoveTemporaries(w->result_.directory, w->name_);
  w->tmp_ = TemporaryName(absl::StrCat(w->result_.directory, "/", w->name_));
  SHARDOPT_ASSIGN_OR_RETURN(w->file_, SequentialWriter::Create(w->tmp_));
  manifest.set_array_alignment(array_alignment);
  const std::string frame = Frame(manifest);
  w->file_->Append(frame.data(), frame.size());
  w->frame_bytes_ = AlignUp(frame.size(), array_alignment);
  w->Pad(w->frame_bytes_ - frame.size(), /*data=*/false);
  w->manifest_ = std::move(manifest);
  w->array_left_ = ArrayBytes(w->manifest_, 0);
  return w;
}

PartWriter::~PartWriter() {
  if (file_) {
    file_.reset();
    unlink(tmp_.c_str());
  }
}

void PartWriter::Append(const void* data, size_t n) {
  if (!file_) return;  // the step is complete already
  // The arrays in the data's order: master, m and v of each shard in turn.
  const size_t arrays = 3 * static_cast<size_t>(manifest_.shards_size());
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    // Past the last array (a caller's mistake) the bytes go on unpadded, and
    // Finish refuses the part's size.
    const size_t take = next_array_ < arrays ? static_cast<size_t>(std::min<uint64_t>(n, array_left_)) : n;
    crc_ = Crc32c(p, take, crc_);
    data_bytes_ += take;
    file_->Append(p, take);
    p += take;
    n -= take;
    array_left_ -= std::min<uint64_t>(array_left_, take);
    if (next_array_ < arrays && array_left_ == 0) {
      Pad(AlignUp(data_bytes_, manifest_.array_alignment()) - data_bytes_, /*data=*/true);
      if (++next_array_ < arrays) array_left_ = ArrayBytes(manifest_, static_cast<int>(next_array_ / 3));
    }
  }
}

void PartWriter::Pad(uint64_t n, bool data) {
  static const char kZeros[kDirectAlignment] = {};
  while (n > 0) {
    const size_t take = static_cast<size_t>(std::min<uint64_t>(n, sizeof kZeros));
    file_->Append(kZeros, take);
    if (data) {
      crc_ = Crc32c(kZeros, take, crc_);
      data_bytes_ += take;
    }
    n -= take;
  }
}

absl::StatusOr<WriteResult> PartWriter::Finish() {
  if (kept_) return CompleteIfTiled();
  if (!file_) return result_;
  // A failed write stopped the data short: the disk's error is the answer.
  if (file_->failed()) return file_->Close();
  if (data_bytes_ != DataBytes(manifest_)) {
    return absl::InternalError(absl::StrCat("a checkpoint part of ", DataBytes(manifest_), " data bytes got ", data_bytes_));
  }
  std::string trailer;
  PutU32(&trailer, crc_);
  file_->Append(trailer.data(), trailer.size());
  SHARDOPT_RETURN_IF_ERROR(file_->Close());
  file_.reset();
  const std::string path = absl::StrCat(result_.directory, "/", name_);
  if (rename(tmp_.c_str(), path.c_str()) != 0) {
    const int error = errno;  // before the message's allocation
    std::error_code ec;
    if (error == ENOENT && fs::exists(result_.directory, ec)) {
      // Only a writer of the same part removes its temporaries (Open): one
      // in another server, which shares this directory and holds a job of
      // this name on this placement. "No such file" alone read as a
      // missing directory (an outside probe).
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot rename into ", path, ": its temporary file ", tmp_, " was removed while it was written, as only "
          "another writer of the same part does: two servers or runs give job ", manifest_.spec().job(),
          " the same placement and share this --checkpoint_dir. Give each run its own job name, or each server its "
          "own directory"));
    }
    const absl::Status st = ErrnoStatus(error, absl::StrCat("cannot rename into ", path));
    unlink(tmp_.c_str());
    return st;
  }
  placed_ = true;
  // The new entries under root must survive a crash too, up to the job's directory.
  for (const std::string& dir : {result_.directory, fs::path(result_.directory).parent_path().string(), root_}) {
    SHARDOPT_RETURN_IF_ERROR(FsyncDirectory(dir));
  }
  result_.part_bytes = frame_bytes_ + data_bytes_ + trailer.size();
  return CompleteIfTiled();
}

absl::StatusOr<WriteResult> PartWriter::CompleteIfTiled() {
  const v1::CreateJobRequest& spec = manifest_.spec();
  std::vector<PartHead> parts;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(result_.directory, ec)) {
    if (!IsPartName(entry.path().filename().string())) continue;
    auto head = ReadPartHead(entry.path().string());
    // A file that cannot be read is no part of this step's (a restore
    // passes it over too); failing for it would block every checkpoint of
    // the step for good.
    if (!head.ok() && head.status().code() == absl::StatusCode::kDataLoss) {
      result_.passed_over.push_back(std::string(head.status().message()));
      continue;
    }
    if (!head.ok()) return head.status();
    SHARDOPT_RETURN_IF_ERROR(SameJob(spec, head->manifest.spec(), head->path, "the part being written's -> that file's"));
    parts.push_back(*std::move(head));
  }
  // This part is there (renamed, or kept), unless the step's directory went.
  if (ec || parts.empty()) {
    return absl::InternalError(absl::StrCat("cannot list ", result_.directory, " with ", name_,
                                            ec ? ": " + ec.message() : ": the part is gone"));
  }
  SHARDOPT_ASSIGN_OR_RETURN(auto tiles, Tiles(parts));
  if (!tiles) return result_;
  // In name order, so that every writer that sees these parts makes the same marker.
  std::sort(parts.begin(), parts.end(), [](const PartHead& a, const PartHead& b) { return a.path < b.path; });
  v1::CommitMarker marker;
  marker.set_job(spec.job());
  marker.set_step(manifest_.step());
  for (const PartHead& p : parts) {
    v1::PartRef* ref = marker.add_parts();
    ref->set_file(fs::path(p.path).filename().string());
    ref->set_bytes(p.file_bytes);
    ref->set_data_crc32c(p.data_crc);
  }
  // Made once: two servers on one directory that tiled the step at the same
  // moment both made it, and both pruned the same old steps after it.
  const std::string frame = Frame(marker);
  const std::string commit = absl::StrCat(result_.directory, "/", kCommitName);
  absl::Status made = WriteFileNew(commit, {frame});
  if (absl::IsAlreadyExists(made)) {
    v1::CommitMarker there;
    if (ReadFrame(commit, &there).ok() && there.SerializeAsString() == marker.SerializeAsString()) {
      // A peer's, of these parts, which it may not have fsynced yet.
      SHARDOPT_RETURN_IF_ERROR(FsyncDirectory(result_.directory));
      result_.complete = true;
      return result_;
    }
    made = WriteFileAtomic(result_.directory, kCommitName, {frame});  // of other parts: this one's, as before
  }
  SHARDOPT_RETURN_IF_ERROR(made);
  result_.complete = true;
  result_.committed_here = true;
  return result_;
}

}  // namespace shardopt::checkpoint
