#include "checkpoint/format.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <optional>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "checkpoint/crc32c.h"
#include "google/protobuf/util/message_differencer.h"

namespace shardopt::checkpoint {
namespace {

namespace fs = std::filesystem;

constexpr char kMagic[8] = {'S', 'H', 'O', 'P', 'T', 'C', 'K', '\n'};
constexpr size_t kHeadBytes = 8 + 4 + 8;  // magic, version, manifest length
constexpr char kCommitName[] = "COMMIT";

void PutU32(std::string* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>(v >> (8 * i)));
}
void PutU64(std::string* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>(v >> (8 * i)));
}
uint64_t GetLE(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t{static_cast<uint8_t>(p[i])} << (8 * i);
  return v;
}

std::string ErrnoText(const std::string& what, const std::string& path) {
  return absl::StrCat(what, " ", path, ": ", std::strerror(errno));
}

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

absl::Status FsyncDirectory(const std::string& dir) {
  Fd fd(open(dir.c_str(), O_RDONLY | O_DIRECTORY));
  if (fd.get() < 0 || fsync(fd.get()) != 0) return absl::InternalError(ErrnoText("cannot fsync directory", dir));
  return absl::OkStatus();
}

// Temp name, write, fsync, rename, fsync the directory: after a crash the
// file is either whole or absent. The temporary name is unique per process
// and call, so that concurrent writers of one file never share one.
absl::Status WriteFileAtomic(const std::string& dir, const std::string& name,
                             std::initializer_list<std::string_view> pieces) {
  static std::atomic<uint64_t> counter{0};
  const std::string path = absl::StrCat(dir, "/", name);
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid(), ".", counter++);
  {
    Fd fd(open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (fd.get() < 0) return absl::InternalError(ErrnoText("cannot create", tmp));
    for (std::string_view piece : pieces) {
      for (size_t done = 0; done < piece.size();) {
        const ssize_t n = write(fd.get(), piece.data() + done, piece.size() - done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
          const absl::Status st = absl::InternalError(ErrnoText("cannot write", tmp));
          unlink(tmp.c_str());
          return st;
        }
        done += static_cast<size_t>(n);
      }
    }
    if (fsync(fd.get()) != 0) {
      const absl::Status st = absl::InternalError(ErrnoText("cannot fsync", tmp));
      unlink(tmp.c_str());
      return st;
    }
  }
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    const absl::Status st = absl::InternalError(ErrnoText("cannot rename into", path));
    unlink(tmp.c_str());
    return st;
  }
  return FsyncDirectory(dir);
}

absl::StatusOr<std::string> ReadRange(const std::string& path, uint64_t offset, uint64_t length) {
  Fd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) {
    return errno == ENOENT ? absl::NotFoundError(ErrnoText("cannot open", path))
                           : absl::DataLossError(ErrnoText("cannot open", path));
  }
  std::string out(length, '\0');
  for (uint64_t done = 0; done < length;) {
    const ssize_t n = pread(fd.get(), out.data() + done, length - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::DataLossError(ErrnoText("cannot read", path));
    if (n == 0) {
      return absl::DataLossError(absl::StrCat(path, " is truncated: it ends before byte ", offset + length));
    }
    done += static_cast<uint64_t>(n);
  }
  return out;
}

absl::StatusOr<uint64_t> FileSize(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    return errno == ENOENT ? absl::NotFoundError(ErrnoText("no file", path))
                           : absl::DataLossError(ErrnoText("cannot stat", path));
  }
  return static_cast<uint64_t>(st.st_size);
}

std::string Frame(const google::protobuf::Message& message) {
  const std::string payload = message.SerializeAsString();
  std::string out(kMagic, sizeof kMagic);
  PutU32(&out, kFormatVersion);
  PutU64(&out, payload.size());
  out += payload;
  PutU32(&out, Crc32c(out.data(), out.size()));
  return out;
}

// Reads and checks the frame at the start of `path` into `message`; returns
// the frame's size, where a part's data begins.
absl::StatusOr<uint64_t> ReadFrame(const std::string& path, google::protobuf::Message* message) {
  SHARDOPT_ASSIGN_OR_RETURN(auto head, ReadRange(path, 0, kHeadBytes));
  if (std::memcmp(head.data(), kMagic, sizeof kMagic) != 0) {
    return absl::DataLossError(absl::StrCat(path, " is not a shardopt checkpoint file (bad magic)"));
  }
  const uint32_t version = static_cast<uint32_t>(GetLE(head.data() + 8, 4));
  if (version != kFormatVersion) {
    return absl::FailedPreconditionError(absl::StrCat(path, " has checkpoint format version ", version,
                                                      "; this build reads version ", kFormatVersion));
  }
  const uint64_t length = GetLE(head.data() + 12, 8);
  SHARDOPT_ASSIGN_OR_RETURN(auto size, FileSize(path));
  if (length > size || kHeadBytes + length + 4 > size) {
    return absl::DataLossError(absl::StrCat(path, " is truncated: its manifest of ", length, " bytes does not fit in ",
                                            size, " bytes"));
  }
  SHARDOPT_ASSIGN_OR_RETURN(auto rest, ReadRange(path, kHeadBytes, length + 4));
  const uint32_t crc = Crc32c(rest.data(), length, Crc32c(head.data(), kHeadBytes));
  if (crc != static_cast<uint32_t>(GetLE(rest.data() + length, 4))) {
    return absl::DataLossError(absl::StrCat(path, ": manifest checksum mismatch (crc32c)"));
  }
  if (!message->ParseFromArray(rest.data(), static_cast<int>(length))) {
    return absl::DataLossError(absl::StrCat(path, ": manifest does not parse"));
  }
  return kHeadBytes + length + 4;
}

}  // namespace

std::string JobDirectoryName(const std::string& job) {
  std::string out;
  for (unsigned char c : job) {
    if (std::isalnum(c) || c == '-' || c == '_' || c == '.') {
      out.push_back(static_cast<char>(c));
    } else {
      absl::StrAppendFormat(&out, "%%%02X", c);
    }
  }
  return out == "." || out == ".." ? absl::StrCat("%2E", out.substr(1)) : out;
}

namespace {

// The fields that make a job what it is; the placement and the barrier's
// deadline may change across a restore.
v1::CreateJobRequest Identity(const v1::CreateJobRequest& spec) {
  v1::CreateJobRequest id = spec;
  id.clear_shards();
  id.clear_barrier_timeout_ms();
  id.clear_restore_step();
  for (v1::Group& g : *id.mutable_groups()) g.clear_name();  // for messages only
  return id;
}

absl::Status SameJob(const v1::CreateJobRequest& a, const v1::CreateJobRequest& b, const std::string& where) {
  std::string diff;
  google::protobuf::util::MessageDifferencer differ;
  differ.ReportDifferencesToString(&diff);
  if (!differ.Compare(Identity(a), Identity(b))) {
    return absl::FailedPreconditionError(absl::StrCat(where, " holds job '", b.job(), "' with another configuration (",
                                                      diff, "); move the checkpoint away or use another job name"));
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

// A part file's manifest, and where and how big its data is.
struct PartHead {
  std::string path;
  v1::PartManifest manifest;
  uint64_t data_offset = 0;
  uint64_t file_bytes = 0;
  uint32_t data_crc = 0;  // as the trailer states it
};

absl::StatusOr<PartHead> ReadPartHead(const std::string& path) {
  PartHead h;
  h.path = path;
  SHARDOPT_ASSIGN_OR_RETURN(auto offset, ReadFrame(path, &h.manifest));
  h.data_offset = offset;
  if (h.manifest.shards_size() != h.manifest.spec().shards_size()) {
    return absl::DataLossError(absl::StrCat(path, ": manifest has ", h.manifest.shards_size(), " sections for ",
                                            h.manifest.spec().shards_size(), " shards"));
  }
  SHARDOPT_ASSIGN_OR_RETURN(auto size, FileSize(path));
  h.file_bytes = size;
  const uint64_t expected = h.data_offset + DataBytes(h.manifest) + 4;
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
      return absl::DataLossError(absl::StrCat(head->path, " is not the part COMMIT recorded (", head->file_bytes,
                                              " bytes, step ", head->manifest.step(), "; COMMIT says ", ref.bytes(),
                                              " bytes, step ", marker.step(), ")"));
    }
    parts.push_back(*std::move(head));
  }
  if (parts.empty()) return absl::DataLossError(absl::StrCat(dir, "/COMMIT lists no parts"));
  for (const PartHead& p : parts) {
    SHARDOPT_RETURN_IF_ERROR(SameJob(parts.front().manifest.spec(), p.manifest.spec(), p.path));
  }
  SHARDOPT_ASSIGN_OR_RETURN(auto tiles, Tiles(parts));
  if (!tiles) return absl::DataLossError(absl::StrCat(dir, ": the parts COMMIT lists do not cover every tensor"));
  return parts;
}

std::vector<uint64_t> StepsNewestFirst(const std::string& job_dir) {
  std::vector<uint64_t> steps;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(job_dir, ec)) {
    const std::string name = entry.path().filename().string();
    uint64_t step;
    if (name.size() == 25 && name.rfind("step-", 0) == 0 && absl::SimpleAtoi(name.substr(5), &step)) {
      steps.push_back(step);
    }
  }
  std::sort(steps.rbegin(), steps.rend());
  return steps;
}

// Streams a part's data to `sink`, checking its crc32c as it goes; the
// mismatch, if any, is known after the last piece.
absl::Status StreamPartData(const PartHead& p, const DataSink& sink) {
  uint32_t crc = 0;
  uint64_t at = 0;
  SHARDOPT_RETURN_IF_ERROR(ReadSequential(p.path, p.data_offset, p.file_bytes - 4 - p.data_offset,
                                          [&](const char* bytes, size_t n) {
                                            crc = Crc32c(bytes, n, crc);
                                            const uint64_t offset = at;
                                            at += n;
                                            return sink(offset, bytes, n);
                                          }));
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

bool IsPartName(const std::string& file) {
  return file.rfind("part-", 0) == 0 && file.size() > 4 && file.compare(file.size() - 4, 4, ".bin") == 0;
}

// Parts of a step that overlap this server's were left by a torn attempt with
// another placement (the peers of one placement never overlap); they would
// keep the step from ever tiling, and nothing complete refers to them.
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

struct Committed {
  std::string dir;
  v1::CommitMarker marker;
  std::vector<PartHead> parts;
};

// The complete checkpoint of `step`, or the newest one when step is 0.
absl::StatusOr<Committed> FindCommitted(const std::string& root, const std::string& job, uint64_t step,
                                        const Log& log) {
  const std::vector<uint64_t> steps = step > 0 ? std::vector<uint64_t>{step} : StepsNewestFirst(absl::StrCat(root, "/", JobDirectoryName(job)));
  for (uint64_t t : steps) {
    Committed c;
    c.dir = StepDirectory(root, job, t);
    std::error_code ec;
    if (!fs::is_directory(c.dir, ec)) {
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

}  // namespace

uint64_t ArrayBytes(const v1::PartManifest& m, int shard) {
  return m.spec().shards(shard).length() * (m.shards(shard).dtype() == v1::FP32 ? 4 : 2);
}

std::vector<uint64_t> SectionOffsets(const v1::PartManifest& m) {
  std::vector<uint64_t> offsets(1, 0);
  for (int s = 0; s < m.shards_size(); ++s) offsets.push_back(offsets.back() + SectionBytes(m, s));
  return offsets;
}

void AppendArray(std::string* data, const float* values, uint64_t count, v1::DType dtype) {
  if (dtype == v1::FP32) {
    data->append(reinterpret_cast<const char*>(values), count * 4);
    return;
  }
  const size_t at = data->size();
  data->resize(at + count * 2);
  for (uint64_t i = 0; i < count; ++i) {
    uint32_t u;
    std::memcpy(&u, &values[i], 4);
    const uint16_t h = static_cast<uint16_t>(u >> 16);  // exact: the value is a bf16 one
    std::memcpy(data->data() + at + 2 * i, &h, 2);
  }
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

std::string StepDirectory(const std::string& root, const std::string& job, uint64_t step) {
  return absl::StrFormat("%s/%s/step-%020u", root, JobDirectoryName(job), step);
}

absl::StatusOr<std::unique_ptr<PartWriter>> PartWriter::Open(const std::string& root, v1::PartManifest manifest) {
  const v1::CreateJobRequest& spec = manifest.spec();
  if (spec.shards_size() == 0 || manifest.shards_size() != spec.shards_size()) {
    return absl::InternalError("a checkpoint part needs shards and a section for each");
  }
  std::unique_ptr<PartWriter> w(new PartWriter());
  w->root_ = root;
  w->result_.directory = StepDirectory(root, spec.job(), manifest.step());
  std::error_code ec;
  fs::create_directories(w->result_.directory, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", w->result_.directory, ": ", ec.message()));
  // A step's state is unique (the step protocol applies each step once), so
  // a complete checkpoint of it needs nothing more, from any placement.
  if (fs::exists(absl::StrCat(w->result_.directory, "/", kCommitName), ec)) {
    w->result_.complete = true;
    w->manifest_ = std::move(manifest);
    return w;
  }
  const v1::ShardRange& first = spec.shards(0);
  w->name_ = absl::StrCat("part-", TensorIndex(spec, first.tensor()), "-", first.offset(), ".bin");
  RemoveOverlappingParts(w->result_.directory, w->name_, spec);
  static std::atomic<uint64_t> counter{0};
  w->tmp_ = absl::StrCat(w->result_.directory, "/", w->name_, ".tmp.", getpid(), ".", counter++);
  SHARDOPT_ASSIGN_OR_RETURN(w->file_, SequentialWriter::Create(w->tmp_));
  const std::string frame = Frame(manifest);
  w->file_->Append(frame.data(), frame.size());
  w->frame_bytes_ = frame.size();
  w->manifest_ = std::move(manifest);
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
  crc_ = Crc32c(data, n, crc_);
  data_bytes_ += n;
  file_->Append(data, n);
}

absl::StatusOr<WriteResult> PartWriter::Finish() {
  if (!file_) return result_;
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
    const absl::Status st = absl::InternalError(ErrnoText("cannot rename into", path));
    unlink(tmp_.c_str());
    return st;
  }
  // The new entries under root must survive a crash too, up to the job's directory.
  for (const std::string& dir : {result_.directory, fs::path(result_.directory).parent_path().string(), root_}) {
    SHARDOPT_RETURN_IF_ERROR(FsyncDirectory(dir));
  }
  result_.part_bytes = frame_bytes_ + data_bytes_ + trailer.size();

  const v1::CreateJobRequest& spec = manifest_.spec();
  std::vector<PartHead> parts;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(result_.directory, ec)) {
    if (!IsPartName(entry.path().filename().string())) continue;
    SHARDOPT_ASSIGN_OR_RETURN(auto head, ReadPartHead(entry.path().string()));
    SHARDOPT_RETURN_IF_ERROR(SameJob(spec, head.manifest.spec(), head.path));
    parts.push_back(std::move(head));
  }
  SHARDOPT_ASSIGN_OR_RETURN(auto tiles, Tiles(parts));
  if (!tiles) return result_;
  v1::CommitMarker marker;
  marker.set_job(spec.job());
  marker.set_step(manifest_.step());
  for (const PartHead& p : parts) {
    v1::PartRef* ref = marker.add_parts();
    ref->set_file(fs::path(p.path).filename().string());
    ref->set_bytes(p.file_bytes);
    ref->set_data_crc32c(p.data_crc);
  }
  SHARDOPT_RETURN_IF_ERROR(WriteFileAtomic(result_.directory, kCommitName, {Frame(marker)}));
  result_.complete = true;
  return result_;
}

std::vector<std::string> Prune(const std::string& root, const std::string& job, uint64_t keep) {
  std::vector<std::string> removed;
  uint64_t complete = 0;
  std::error_code ec;
  for (uint64_t step : StepsNewestFirst(absl::StrCat(root, "/", JobDirectoryName(job)))) {
    const std::string dir = StepDirectory(root, job, step);
    if (complete >= keep) {
      // Another server of the job may prune the same directory at once.
      fs::remove_all(dir, ec);
      removed.push_back(dir);
    } else if (fs::exists(absl::StrCat(dir, "/", kCommitName), ec)) {
      ++complete;
    }
  }
  return removed;
}

namespace {

// The manifest a load of `spec` from `committed` answers with: the job's
// step and last commit, and, where a part has this very placement, that
// part's sections and its sealed push's sums (which are per server).
v1::PartManifest LoadedManifest(const Committed& committed, const v1::CreateJobRequest& spec, const PartHead* same) {
  v1::PartManifest m;
  *m.mutable_spec() = spec;
  m.set_step(committed.marker.step());
  *m.mutable_applied() = committed.parts.front().manifest.applied();
  if (same != nullptr) {
    m.set_sealed_step(same->manifest.sealed_step());
    m.set_sealed_sum_squares(same->manifest.sealed_sum_squares());
    m.set_sealed_nonfinite(same->manifest.sealed_nonfinite());
    *m.mutable_shards() = same->manifest.shards();
  }
  return m;
}

const PartHead* SamePlacement(const Committed& committed, const v1::CreateJobRequest& spec) {
  for (const PartHead& p : committed.parts) {
    if (SameShards(p.manifest.spec(), spec)) return &p;
  }
  return nullptr;
}

}  // namespace

absl::StatusOr<v1::PartManifest> LoadInto(const std::string& root, const v1::CreateJobRequest& spec, uint64_t step,
                                          const Log& log,
                                          const std::function<absl::Status(const v1::PartManifest&)>& begin,
                                          const DataSink& sink) {
  SHARDOPT_ASSIGN_OR_RETURN(auto committed, FindCommitted(root, spec.job(), step, log));
  SHARDOPT_RETURN_IF_ERROR(SameJob(spec, committed.parts.front().manifest.spec(), committed.dir));
  // The same placement, as on a plain restart: the part's data is the answer
  // as it lies on disk, streamed.
  if (const PartHead* same = SamePlacement(committed, spec)) {
    v1::PartManifest manifest = LoadedManifest(committed, spec, same);
    SHARDOPT_RETURN_IF_ERROR(begin(manifest));
    SHARDOPT_RETURN_IF_ERROR(StreamPartData(*same, sink));
    return manifest;
  }
  SHARDOPT_ASSIGN_OR_RETURN(auto part, Load(root, spec, step, log));
  SHARDOPT_RETURN_IF_ERROR(begin(part.manifest));
  SHARDOPT_RETURN_IF_ERROR(sink(0, part.data.data(), part.data.size()));
  return part.manifest;
}

absl::StatusOr<Part> Load(const std::string& root, const v1::CreateJobRequest& spec, uint64_t step, const Log& log) {
  SHARDOPT_ASSIGN_OR_RETURN(auto committed, FindCommitted(root, spec.job(), step, log));
  SHARDOPT_RETURN_IF_ERROR(SameJob(spec, committed.parts.front().manifest.spec(), committed.dir));
  Part out;
  const PartHead* same = SamePlacement(committed, spec);
  out.manifest = LoadedManifest(committed, spec, same);
  v1::PartManifest& m = out.manifest;
  if (same != nullptr) {
    SHARDOPT_ASSIGN_OR_RETURN(auto data, ReadPartData(*same));
    out.data = std::move(data);
    return out;
  }
  for (const v1::ShardRange& s : spec.shards()) {
    const int t = TensorIndex(spec, s.tensor());
    v1::ShardSection* section = m.add_shards();
    section->set_dtype(spec.groups(spec.tensors(t).group()).precision() == v1::PRECISION_BF16 ? v1::BF16 : v1::FP32);
  }
  const std::vector<uint64_t> to_sections = SectionOffsets(m);
  out.data.resize(to_sections.back());

  std::vector<uint64_t> filled(spec.shards_size(), 0);
  std::vector<bool> step_known(spec.shards_size(), false);
  for (const PartHead& p : committed.parts) {
    std::optional<std::string> data;  // read only when the part overlaps this placement
    const v1::PartManifest& src = p.manifest;
    const std::vector<uint64_t> from_sections = SectionOffsets(src);
    for (int ss = 0; ss < src.shards_size(); ++ss) {
      const v1::ShardRange& from = src.spec().shards(ss);
      for (int ds = 0; ds < spec.shards_size(); ++ds) {
        const v1::ShardRange& to = spec.shards(ds);
        const uint64_t begin = std::max(from.offset(), to.offset());
        const uint64_t end = std::min(from.offset() + from.length(), to.offset() + to.length());
        if (from.tensor() != to.tensor() || begin >= end) continue;
        if (src.shards(ss).dtype() != m.shards(ds).dtype()) {
          return absl::DataLossError(absl::StrCat(p.path, " holds tensor '", from.tensor(), "' as ",
                                                  v1::DType_Name(src.shards(ss).dtype()), ", its group asks for ",
                                                  v1::DType_Name(m.shards(ds).dtype())));
        }
        if (step_known[ds] && m.shards(ds).adam_step() != src.shards(ss).adam_step()) {
          return absl::DataLossError(absl::StrCat(p.path, ": tensor '", from.tensor(), "' has Adam step ",
                                                  src.shards(ss).adam_step(), " here and ", m.shards(ds).adam_step(),
                                                  " in another part"));
        }
        m.mutable_shards(ds)->set_adam_step(src.shards(ss).adam_step());
        step_known[ds] = true;
        if (!data) {
          SHARDOPT_ASSIGN_OR_RETURN(auto read, ReadPartData(p));
          data = std::move(read);
        }
        const uint64_t esize = ArrayBytes(src, ss) / from.length();
        for (Array a : kArrays) {
          std::memcpy(out.data.data() + ArrayOffset(to_sections, m, ds, a) + (begin - to.offset()) * esize,
                      data->data() + ArrayOffset(from_sections, src, ss, a) + (begin - from.offset()) * esize,
                      (end - begin) * esize);
        }
        filled[ds] += end - begin;
      }
    }
  }
  for (int ds = 0; ds < spec.shards_size(); ++ds) {
    if (filled[ds] != spec.shards(ds).length()) {
      return absl::DataLossError(absl::StrCat(committed.dir, ": the parts do not cover tensor '",
                                              spec.shards(ds).tensor(), "' from element ", spec.shards(ds).offset()));
    }
  }
  return out;
}

absl::StatusOr<JobAt> WholeJob(const std::string& root, const std::string& job, uint64_t step, const Log& log) {
  SHARDOPT_ASSIGN_OR_RETURN(auto committed, FindCommitted(root, job, step, log));
  JobAt out;
  out.step = committed.marker.step();
  out.spec = committed.parts.front().manifest.spec();
  out.spec.clear_shards();
  for (const v1::TensorSpec& t : out.spec.tensors()) {
    v1::ShardRange* s = out.spec.add_shards();
    s->set_tensor(t.name());
    s->set_offset(0);
    s->set_length(t.numel());
  }
  return out;
}

}  // namespace shardopt::checkpoint
