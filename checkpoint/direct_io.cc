#include "checkpoint/direct_io.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/files.h"

namespace shardopt::checkpoint {
namespace {

uint64_t RoundDown(uint64_t n) { return n / kDirectAlignment * kDirectAlignment; }
uint64_t RoundUp(uint64_t n) { return RoundDown(n + kDirectAlignment - 1); }

// O_DIRECT where the file system has it; some (older tmpfs, FUSE, network
// file systems) refuse the flag, and then the same calls go through the page
// cache. The flag is set after the open: an open(O_CREAT | O_DIRECT) that
// fails for the flag has already created the file.
int OpenMaybeDirect(const std::string& path, int flags) {
  const int fd = open(path.c_str(), flags | O_CLOEXEC, 0644);
  if (fd < 0) return fd;
  const int status = fcntl(fd, F_GETFL);
  if (status >= 0) fcntl(fd, F_SETFL, status | O_DIRECT);  // EINVAL: stays buffered
  return fd;
}

}  // namespace

AlignedBytes AllocateAligned(size_t bytes) {
  // A buffer of whole huge pages, where the kernel grants them, is mapped
  // in 4 faults instead of 2048 per 8 MiB, and an O_DIRECT call pins 4
  // pages of it instead of 2048: both the snapshot's copies into fresh
  // buffers and the disk's reads and writes from them are faster (README,
  // "Measured").
  constexpr size_t kHugePage = size_t{2} << 20;
  const bool huge = bytes >= kHugePage && bytes % kHugePage == 0;
  void* p = nullptr;
  if (posix_memalign(&p, huge ? kHugePage : kDirectAlignment, bytes) != 0) std::abort();
  if (huge) madvise(p, bytes, MADV_HUGEPAGE);
  return AlignedBytes(static_cast<char*>(p));
}

absl::StatusOr<std::unique_ptr<SequentialWriter>> SequentialWriter::Create(const std::string& path,
                                                                           WriteAt write_at) {
  const int fd = OpenMaybeDirect(path, O_WRONLY | O_CREAT | O_EXCL);
  if (fd < 0) return absl::InternalError(ErrnoText("cannot create", path));
  return std::unique_ptr<SequentialWriter>(
      new SequentialWriter(fd, path, write_at ? std::move(write_at) : WriteAt(&::pwrite)));
}

SequentialWriter::SequentialWriter(int fd, std::string path, WriteAt write_at)
    : fd_(fd), path_(std::move(path)), write_at_(std::move(write_at)), current_(AllocateAligned(kDirectChunkBytes)),
      thread_([this] { Run(); }) {}

SequentialWriter::~SequentialWriter() {
  {
    absl::MutexLock lock(&mu_);
    closing_ = true;
  }
  if (thread_.joinable()) thread_.join();
  if (fd_ >= 0) close(fd_);
}

void SequentialWriter::Append(const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  bytes_ += n;
  while (n > 0) {
    const size_t take = std::min(n, fill_ - used_);
    std::memcpy(current_.get() + used_, p, take);
    used_ += take;
    p += take;
    n -= take;
    if (used_ == fill_) Submit();
  }
}

void SequentialWriter::Submit() {
  // The last buffer is padded to the alignment O_DIRECT needs; Close cuts
  // the file back to its size.
  const size_t length = RoundUp(used_);
  std::memset(current_.get() + used_, 0, length - used_);
  AlignedBytes next;
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](SequentialWriter* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->mu_) {
          return w->queue_.size() < kQueuedBuffers || !w->error_.ok();
        },
        this));
    // After a failed write the file is lost: the rest is dropped, not
    // queued, and Close reports the error.
    if (!error_.ok()) {
      used_ = 0;
      return;
    }
    queue_.emplace_back(std::move(current_), length);
    if (!spare_.empty()) {
      next = std::move(spare_.back());
      spare_.pop_back();
    }
  }
  current_ = next ? std::move(next) : AllocateAligned(kDirectChunkBytes);
  used_ = 0;
  fill_ = std::min(2 * fill_, kDirectChunkBytes);
}

void SequentialWriter::Run() {
  absl::MutexLock lock(&mu_);
  for (;;) {
    mu_.Await(absl::Condition(
        +[](SequentialWriter* w) ABSL_EXCLUSIVE_LOCKS_REQUIRED(w->mu_) { return w->closing_ || !w->queue_.empty(); },
        this));
    if (queue_.empty()) return;  // closing, and everything is written
    auto [buffer, length] = std::move(queue_.front());
    queue_.pop_front();
    const uint64_t at = written_;
    written_ += length;
    const bool failed = !error_.ok();  // then what was queued before is dropped
    mu_.Unlock();
    absl::Status status;
    for (size_t done = 0; done < length && status.ok() && !failed;) {
      const ssize_t n = write_at_(fd_, buffer.get() + done, length - done, static_cast<off_t>(at + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) status = absl::InternalError(ErrnoText("cannot write", path_));
      done += n > 0 ? static_cast<size_t>(n) : 0;
    }
    mu_.Lock();
    if (error_.ok()) error_ = status;
    // A few buffers come back for reuse: their pages are already mapped.
    if (spare_.size() < 4) spare_.push_back(std::move(buffer));
  }
}

absl::Status SequentialWriter::Close() {
  if (used_ > 0) Submit();
  {
    absl::MutexLock lock(&mu_);
    closing_ = true;
  }
  thread_.join();
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    status = error_;
  }
  if (!status.ok()) return status;
  if (ftruncate(fd_, static_cast<off_t>(bytes_)) != 0) return absl::InternalError(ErrnoText("cannot truncate", path_));
  if (fsync(fd_) != 0) return absl::InternalError(ErrnoText("cannot fsync", path_));
  return absl::OkStatus();
}

absl::Status ReadSequential(const std::string& path, uint64_t offset, uint64_t length,
                            const std::function<absl::Status(const char* data, size_t n)>& sink,
                            const Place& place) {
  // Reads go through the page cache with the kernel's readahead, which
  // needs no alignment, so they can land anywhere `place` says. O_DIRECT
  // would need the file's offsets and the memory to share an alignment,
  // which a part's arrays, after a frame of any length, do not.
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd >= 0) posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  if (fd < 0) {
    return errno == ENOENT ? absl::NotFoundError(ErrnoText("cannot open", path))
                           : absl::DataLossError(ErrnoText("cannot open", path));
  }
  struct Piece {
    AlignedBytes buffer;  // null when the piece was read to where `place` said
    const char* data = nullptr;
    size_t want = 0, got = 0;
    absl::Status status;
  };
  std::mutex mu;
  std::condition_variable changed;
  std::optional<Piece> ready;  // these three under mu
  std::vector<AlignedBytes> spare;
  bool stop = false;
  spare.push_back(AllocateAligned(kDirectChunkBytes));
  spare.push_back(AllocateAligned(kDirectChunkBytes));
  // The reader thread runs ahead of the sink: one piece waits in `ready`,
  // and a placed one, needing no spare buffer, may be read meanwhile.
  std::thread reader([&] {
    for (uint64_t at = 0; at < length;) {
      Piece piece;
      piece.want = static_cast<size_t>(std::min<uint64_t>(kDirectChunkBytes, length - at));
      const Destination d = place ? place(at, piece.want) : Destination{};
      char* to = d.to;
      if (d.n > 0) piece.want = std::min(piece.want, d.n);
      if (to == nullptr) {
        std::unique_lock<std::mutex> lock(mu);
        changed.wait(lock, [&] { return !spare.empty() || stop; });
        if (stop) return;
        piece.buffer = std::move(spare.back());
        spare.pop_back();
        to = piece.buffer.get();
      }
      piece.data = to;
      while (piece.got < piece.want) {
        const ssize_t n = pread(fd, to + piece.got, piece.want - piece.got, static_cast<off_t>(offset + at + piece.got));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) piece.status = absl::DataLossError(ErrnoText("cannot read", path));
        if (n <= 0) break;
        piece.got += static_cast<size_t>(n);
      }
      const bool last = piece.got < piece.want;
      at += piece.want;
      std::unique_lock<std::mutex> lock(mu);
      changed.wait(lock, [&] { return !ready.has_value() || stop; });
      if (stop) return;
      ready = std::move(piece);
      changed.notify_all();
      if (last) return;
    }
  });
  absl::Status status;
  for (uint64_t delivered = 0; delivered < length && status.ok();) {
    Piece piece;
    {
      std::unique_lock<std::mutex> lock(mu);
      changed.wait(lock, [&] { return ready.has_value(); });
      piece = std::move(*ready);
      ready.reset();
      changed.notify_all();
    }
    status = piece.status;
    if (status.ok() && piece.got < piece.want) {
      status = absl::DataLossError(absl::StrCat(path, " is truncated: it ends before byte ", offset + length));
    }
    if (status.ok()) status = sink(piece.data, piece.got);
    delivered += piece.got;
    if (piece.buffer != nullptr) {
      std::lock_guard<std::mutex> lock(mu);
      spare.push_back(std::move(piece.buffer));
      changed.notify_all();
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    stop = true;
    changed.notify_all();
  }
  reader.join();
  close(fd);
  return status;
}

}  // namespace shardopt::checkpoint
