#include "checkpoint/directory_id.h"

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
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

absl::Status KeepDirectoryId(const std::string& root, const std::string& id) {
  std::error_code ec;
  if (!std::filesystem::is_directory(root, ec)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--checkpoint_dir=", root, " is gone since this server started (deleted, or its volume unmounted): put it "
        "back, or restart the server on the job's directory; nothing was written"));
  }
  const std::string path = absl::StrCat(root, "/", kDirectoryIdName);
  auto held = ReadId(path);
  if (held.status().code() == absl::StatusCode::kNotFound) {
    const absl::Status written = WriteFileNew(path, {absl::StrCat(id, "\n")});
    if (!written.ok() && written.code() != absl::StatusCode::kAlreadyExists) return written;
    held = ReadId(path);  // a peer's, written a moment before, or this one's
  }
  if (!held.ok()) return held.status();
  if (*held != id) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " says directory id ", *held, ", not ", id, ", which this server read at its start: the directory was "
        "replaced since; restart the server (and its peers) on the job's directory; nothing was written"));
  }
  return absl::OkStatus();
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
