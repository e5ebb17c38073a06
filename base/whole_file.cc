#include "base/whole_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/errno_status.h"

namespace shardopt {

std::string TemporaryName(const std::string& path) {
  static std::atomic<uint64_t> counter{0};
  return absl::StrCat(path, ".tmp.", getpid(), ".", absl::ToUnixNanos(absl::Now()), ".", counter++);
}

int WriteAll(int fd, absl::Span<const std::string_view> pieces) {
  for (std::string_view piece : pieces) {
    for (size_t done = 0; done < piece.size();) {
      const ssize_t n = write(fd, piece.data() + done, piece.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return n < 0 ? errno : ENOSPC;
      done += static_cast<size_t>(n);
    }
  }
  return 0;
}

namespace {

// WriteFileWhole's and WriteFileNew's steps; `replace` says which of the two.
absl::Status WriteFile(const std::string& path, absl::Span<const std::string_view> pieces, bool replace) {
  const std::string tmp = TemporaryName(path);
  // Named by `path`, the file the caller asked for: the temporary name is
  // what failed, but not what the caller knows.
  const auto failed = [&](const char* doing, int error) {
    return ErrnoStatus(error, absl::StrCat("cannot write ", path, ": ", doing, " its temporary ", tmp));
  };
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
  if (fd < 0) return failed("creating", errno);
  const char* doing = "writing";
  int error = WriteAll(fd, pieces);
  if (error == 0 && fsync(fd) != 0) {
    error = errno;
    doing = "fsyncing";
  }
  if (close(fd) != 0 && error == 0) error = errno;
  if (error == 0 && replace && rename(tmp.c_str(), path.c_str()) != 0) {
    error = errno;
    doing = "renaming";
  }
  if (error == 0 && !replace) {
    // A hard link fails if the name is taken, where a rename replaces it.
    // A filesystem without hard links (some FUSE and SMB mounts, which fail
    // it with EPERM, ENOTSUP, EACCES or EIO) gets the rename: a checkpoint
    // must not fail for it, and it is no worse than before (untested here:
    // every filesystem of this machine has links).
    if (link(tmp.c_str(), path.c_str()) != 0) error = errno;
    if (error != 0 && error != EEXIST) {
      error = rename(tmp.c_str(), path.c_str()) == 0 ? 0 : errno;
      doing = "renaming";
    }
    unlink(tmp.c_str());
    if (error == EEXIST) return absl::AlreadyExistsError(absl::StrCat(path, " is there already"));
  }
  if (error != 0) {
    unlink(tmp.c_str());
    return failed(doing, error);
  }
  // The new file is in place already: a failure here says so.
  if (absl::Status synced = FsyncDirectory(DirectoryOf(path)); !synced.ok()) {
    return absl::Status(synced.code(), absl::StrCat(path, " is written in place, but ", synced.message(),
                                                    ": a crash may still bring back the file it replaced"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status WriteFileWhole(const std::string& path, absl::Span<const std::string_view> pieces) {
  return WriteFile(path, pieces, /*replace=*/true);
}

absl::Status WriteFileNew(const std::string& path, absl::Span<const std::string_view> pieces) {
  return WriteFile(path, pieces, /*replace=*/false);
}

std::string DirectoryOf(const std::string& path) {
  const std::string dir = std::filesystem::path(path).parent_path().string();
  return dir.empty() ? "." : dir;
}

absl::Status FsyncDirectory(const std::string& dir) {
  const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  const bool synced = fd >= 0 && fsync(fd) == 0;
  const int error = errno;
  if (fd >= 0) close(fd);
  if (!synced) return ErrnoStatus(error, absl::StrCat("cannot fsync directory ", dir));
  return absl::OkStatus();
}

}  // namespace shardopt
