#include "checkpoint/directory_id.h"

#include <algorithm>
#include <cstdint>
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
  std::string id;
  if (size <= kMaxIdBytes + 1) {  // a line's end besides
    SHARDOPT_ASSIGN_OR_RETURN(id, ReadRange(path, 0, size));
    if (!id.empty() && id.back() == '\n') id.pop_back();
  }
  const bool printable = std::all_of(id.begin(), id.end(), [](char c) { return absl::ascii_isgraph(static_cast<unsigned char>(c)); });
  if (id.empty() || id.size() > kMaxIdBytes || !printable) {
    return absl::FailedPreconditionError(absl::StrCat(
        path, " is not a directory id (one line of 1 to ", kMaxIdBytes, " printable bytes; it holds ", size,
        " bytes): remove it only if no server uses this directory, and the servers started then make a new one"));
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
