#include "checkpoint/directory_id.h"

#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "base/whole_file.h"
#include "checkpoint/files.h"

namespace shardopt::checkpoint {
namespace {

constexpr size_t kMaxIdBytes = 64;

absl::StatusOr<std::string> ReadId(const std::string& path) {
  auto size = FileSize(path);
  if (!size.ok()) return size.status();
  if (*size == 0 || *size > kMaxIdBytes + 1) {
    return absl::FailedPreconditionError(absl::StrCat(path, " holds ", *size, " bytes, not a directory id (1 to ",
                                                      kMaxIdBytes, "): remove it only if no server uses this "
                                                      "directory, and every server then started makes a new one"));
  }
  SHARDOPT_ASSIGN_OR_RETURN(std::string id, ReadRange(path, 0, *size));
  if (!id.empty() && id.back() == '\n') id.pop_back();
  for (char c : id) {
    if (!absl::ascii_isgraph(static_cast<unsigned char>(c))) {
      return absl::FailedPreconditionError(absl::StrCat(path, " is not one line of printable text, as a directory id "
                                                        "is: remove it only if no server uses this directory"));
    }
  }
  if (id.empty()) return absl::FailedPreconditionError(absl::StrCat(path, " holds an empty directory id"));
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
  const std::string made = NewId();
  const absl::Status written = WriteFileNew(path, {absl::StrCat(made, "\n")});
  if (written.ok()) return made;
  // Another server made it a moment before.
  if (written.code() == absl::StatusCode::kAlreadyExists) return ReadId(path);
  return written;
}

}  // namespace shardopt::checkpoint
