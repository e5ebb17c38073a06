// A file written so that a reader, or a crash, finds the old file or the new
// one whole, never part of one: the bytes go to a temporary name beside it,
// are fsynced, and the name is renamed over it. The checkpoint's files and
// export's safetensors are written so.
#pragma once

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace shardopt {

// A temporary name beside `path` that no other writer picks: the process
// id, the time in nanoseconds and a counter (a server in a pod is always
// pid 1, and its counter starts at 0 again after a restart; two servers on
// a shared directory may both be pid 1).
std::string TemporaryName(const std::string& path);

// Writes every piece to `fd`, in order, through short writes and EINTR: 0,
// or the errno of the write that failed.
int WriteAll(int fd, absl::Span<const std::string_view> pieces);

// Temporary name, write, fsync, rename over `path` (mode 0666 less the
// umask), then fsync of the directory, so that the rename outlives a crash.
// An error (its code by ErrnoCode: a full disk is RESOURCE_EXHAUSTED) names
// `path`, then what failed of its temporary (creating, writing, fsyncing or
// renaming it), and the system's reason; the temporary is removed if the
// rename did not happen, and a failed fsync of the directory says that the
// new file is in place.
absl::Status WriteFileWhole(const std::string& path, absl::Span<const std::string_view> pieces);
// The same, but never over a file already at `path`: the temporary is
// linked to `path` instead of renamed, and ALREADY_EXISTS, with nothing
// changed, if another writer's file is there, even one linked a moment
// before. Of two writers at once, exactly one makes the file, where the
// filesystem has hard links; where it has none, the link's error makes this
// rename, as WriteFileWhole does, and both writers make it.
absl::Status WriteFileNew(const std::string& path, absl::Span<const std::string_view> pieces);

// The directory `path` names a file in ("." for a bare name).
std::string DirectoryOf(const std::string& path);

// fsync of a directory: the names made or renamed in it are on disk.
absl::Status FsyncDirectory(const std::string& dir);

}  // namespace shardopt
