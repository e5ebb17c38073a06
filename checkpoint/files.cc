#include "checkpoint/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "checkpoint/crc32c.h"
#include "checkpoint/format.h"
#include "google/protobuf/message.h"

namespace shardopt::checkpoint {
namespace {

constexpr char kMagic[8] = {'S', 'H', 'O', 'P', 'T', 'C', 'K', '\n'};
constexpr size_t kHeadBytes = 8 + 4 + 8;  // magic, version, manifest length

void PutU64(std::string* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>(v >> (8 * i)));
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

}  // namespace

void PutU32(std::string* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>(v >> (8 * i)));
}
uint64_t GetLE(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t{static_cast<uint8_t>(p[i])} << (8 * i);
  return v;
}

std::string ErrnoText(const std::string& what, const std::string& path) {
  return absl::StrCat(what, " ", path, ": ", std::strerror(errno));
}

// Concurrent writers of one file (servers completing a step at once) never
// share a temporary name.
absl::Status WriteFileAtomic(const std::string& dir, const std::string& name,
                             std::initializer_list<std::string_view> pieces) {
  return WriteFileWhole(absl::StrCat(dir, "/", name), {pieces.begin(), pieces.size()});
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
  if (version < kOldestReadableFormatVersion || version > kFormatVersion) {
    return absl::FailedPreconditionError(absl::StrCat(path, " has checkpoint format version ", version,
                                                      "; this build reads versions ", kOldestReadableFormatVersion,
                                                      " to ", kFormatVersion));
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
}  // namespace shardopt::checkpoint
