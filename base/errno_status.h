// A failed system call's errno as a Status whose code tells a caller what to
// do about it, where INTERNAL alone would read as a bug of the server: a
// full disk or quota is RESOURCE_EXHAUSTED (gRPC's code for "the file system
// is out of space"), a read-only, forbidden or missing directory, or a
// directory where a file is to be written, FAILED_PRECONDITION (an
// operator's setting to fix), anything else INTERNAL.
#pragma once

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace shardopt {

// The code for `error` as above.
absl::StatusCode ErrnoCode(int error);
// `message: strerror(error)`, with ErrnoCode(error).
absl::Status ErrnoStatus(int error, absl::string_view message);

}  // namespace shardopt
