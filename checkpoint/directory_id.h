// The identity of a --checkpoint_dir: a random id written once in its root,
// which every server on that directory reports (DescribeResponse
// .checkpoint_dir_id), so that a client can tell servers that share one
// directory from servers that each have their own. A job's checkpoint
// completes only where one server sees every part, so servers of one job on
// separate directories would write parts that never complete, and lose the
// job at their next restart; the same path proves nothing (every pod mounts
// its own volume at the same one).
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace shardopt::checkpoint {

// The file in the directory's root: a '+' is never in a job's directory
// name (JobDirectoryName writes it %2B), so no job's directory is this.
inline constexpr char kDirectoryIdName[] = "shardopt+directory-id";

// The directory's id, made now (32 hex digits from the system's random
// source) if the directory has none. Of servers starting at once on an
// empty shared directory, one makes it (WriteFileNew) and the others read
// that one (where the filesystem has hard links; without them, a server
// that read its own id before another's rename replaced it keeps it until
// it restarts). An id file that is empty, longer than 64 bytes or not one
// line of printable text is FAILED_PRECONDITION: it is not what this made,
// and a made-up id in its place would tell this server apart from those
// that read the old one.
absl::StatusOr<std::string> DirectoryId(const std::string& root);

// The device `root` is on (stat's st_dev), for KeepDirectoryId.
absl::StatusOr<uint64_t> DirectoryDevice(const std::string& root);

// Before each checkpoint, that `root` is still on `device`, where this
// server found it at its start: FAILED_PRECONDITION if not, nothing written
// (its volume unmounted, or another one mounted there: a checkpoint would go
// to the disk below, lost with the pod, or to another volume than its
// peers'). A new empty volume that got the old one's device number reads as
// the directory emptied, below.
// A `root` deleted since (a directory inside the volume) is made again, and
// an id file deleted with old checkpoints is written again, both with `id`,
// which every server on the directory read at its start, so that servers
// started later read the same.
absl::Status KeepDirectoryId(const std::string& root, const std::string& id, uint64_t device);

}  // namespace shardopt::checkpoint
