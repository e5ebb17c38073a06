#include "base/errno_status.h"

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace shardopt {

absl::StatusCode ErrnoCode(int error) {
  switch (error) {
    case ENOSPC:  // the filesystem is full
    case EDQUOT:  // the user's quota on it is
    case EFBIG:   // past the file size limit (RLIMIT_FSIZE) or the filesystem's largest file
    case EMFILE:  // the process's open files at RLIMIT_NOFILE (a server's connections hold them)
    case ENFILE:  // the system's
      return absl::StatusCode::kResourceExhausted;
    case EROFS:   // mounted read-only
    case EACCES:  // the directory's permissions
    case EPERM:
    case ENOENT:   // a directory on the path is gone
    case ENOTDIR:  // or is a file
    case EISDIR:   // the file to write is a directory (an export's OUT, say)
      return absl::StatusCode::kFailedPrecondition;
    default:
      return absl::StatusCode::kInternal;
  }
}

absl::Status ErrnoStatus(int error, absl::string_view message) {
  return absl::Status(ErrnoCode(error), absl::StrCat(message, ": ", std::strerror(error)));
}

}  // namespace shardopt
