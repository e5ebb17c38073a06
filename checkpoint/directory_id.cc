#include "checkpoint/directory_id.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <filesystem>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "base/whole_file.h"
#include "checkpoint/files.h"

namespace shardopt::checkpoint {
namespace {

// An id goes into every Describe and log line: one made here is 32 bytes,
// one written by hand is held to twice that.
constexpr size_t kMaxIdBytes = 64;

absl::StatusOr<std::string> ReadId(const std::string& path) {
  SHARDOPT_ASSIGN_OR_RETURN(const uint64_t size, FileSize(path));
  std::error_code ec;
  const bool file = std::filesystem::is_regular_file(path, ec);
  std::string id;
  if (file && size <= kMaxIdBytes + 1) {  // a line's end besides
    SHARDOPT_ASSIGN_OR_RETURN(id, ReadRange(path, 0, size));
    if (!id.empty() && id.back() == '\n') id.pop_back();
  }
  const bool printable = std::all_of(id.begin(), id.end(), [](char c) { return absl::ascii_isgraph(static_cast<unsigned char>(c)); });
  if (id.empty() || id.size() > kMaxIdBytes || !printable) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " is not a directory id (a file of one line of 1 to ", kMaxIdBytes, " printable bytes, no spaces; ",
        file ? absl::StrCat("it holds ", size, " bytes") : "it is no file",
        "): remove it only if no server uses this directory, and the servers started then make a new one"));
  }
  return id;
}

std::string NewId() {
  std::random_device random;
  std::string id;
  for (int i = 0; i < 4; ++i) absl::StrAppendFormat(&id, "%08x", random());
  return id;
}

}  // namespace

absl::StatusOr<uint64_t> DirectoryDevice(const std::string& root) {
  struct stat st;
  if (stat(root.c_str(), &st) != 0) {
    const int error = errno;  // before the message's allocation
    return ErrnoStatus(error, absl::StrCat("cannot stat --checkpoint_dir=", root));
  }
  return static_cast<uint64_t>(st.st_dev);
}

absl::Status KeepDirectoryId(const std::string& root, const std::string& id, uint64_t device) {
  std::error_code ec;
  // Deleted inside its volume: made again, where its parent is on that
  // volume still (not the disk below an unmounted one).
  const std::string parent = std::filesystem::path(root).parent_path().string();
  if (!std::filesystem::exists(root, ec) && DirectoryDevice(parent.empty() ? "." : parent).value_or(device + 1) == device) {
    std::filesystem::create_directories(root, ec);
  }
  const uint64_t now = DirectoryDevice(root).value_or(device + 1);  // gone: not the device
  if (now != device) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--checkpoint_dir=", root, " is on another device than when this server started (its volume unmounted, or "
        "another mounted there): nothing was written; mount the job's volume there again, or restart the server"));
  }
  const std::string path = absl::StrCat(root, "/", kDirectoryIdName);
  if (std::filesystem::exists(path, ec)) return absl::OkStatus();
  const absl::Status written = WriteFileNew(path, {absl::StrCat(id, "\n")});
  return written.code() == absl::StatusCode::kAlreadyExists ? absl::OkStatus() : written;  // a peer's, just now
}

absl::StatusOr<std::string> DirectoryId(const std::string& root) {
  const std::string path = absl::StrCat(root, "/", kDirectoryIdName);
  auto id = ReadId(path);
  if (id.status().code() != absl::StatusCode::kNotFound) return id;
  const absl::Status written = WriteFileNew(path, {absl::StrCat(NewId(), "\n")});
  // Read back, also after this one made it: on a filesystem without hard
  // links WriteFileNew renames, and of servers starting at once the last
  // rename's id is the directory's (one read before it can still differ:
  // the attach then refuses, and a restart of that server clears it).
  if (written.ok() || written.code() == absl::StatusCode::kAlreadyExists) return ReadId(path);
  return written;
}

}  // namespace shardopt::checkpoint
