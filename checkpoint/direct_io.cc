#include "checkpoint/direct_io.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/errno_status.h"
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

// Clears O_DIRECT, if the descriptor has it, so that the next calls go
// through the page cache; false when it was not set.
bool StopDirect(int fd) {
  const int status = fcntl(fd, F_GETFL);
  return status >= 0 && (status & O_DIRECT) != 0 && fcntl(fd, F_SETFL, status & ~O_DIRECT) == 0;
}

}  // namespace

namespace {

constexpr size_t kHugePage = size_t{2} << 20;

bool WholeHugePages(size_t bytes) { return bytes >= kHugePage && bytes % kHugePage == 0; }

}  // namespace

BufferPool& BufferPool::Default() {
  static BufferPool* pool = new BufferPool(SequentialWriter::kMostBytes + kReadBuffers * kReadBufferBytes);
  return *pool;
}

BufferPool::~BufferPool() {
  absl::MutexLock lock(&mu_);
  for (const auto& [bytes, p] : free_) std::free(p);
}

AlignedBytes BufferPool::Allocate(size_t bytes) {
  const bool huge = WholeHugePages(bytes);
  if (huge) {
    absl::MutexLock lock(&mu_);
    for (auto it = free_.rbegin(); it != free_.rend(); ++it) {
      if (it->first != bytes) continue;
      char* p = it->second;
      free_.erase(std::next(it).base());
      pooled_ -= bytes;
      return AlignedBytes(p, AlignedFree{bytes, this});
    }
  }
  // A buffer of whole huge pages, where the kernel grants them, is mapped
  // in 4 faults instead of 2048 per 8 MiB, and an O_DIRECT call pins 4
  // pages of it instead of 2048: both the snapshot's copies into fresh
  // buffers and the disk's reads and writes from them are faster
  // (docs/measurements.md, "Checkpoint write and restore").
  void* p = nullptr;
  if (posix_memalign(&p, huge ? kHugePage : kDirectAlignment, bytes) != 0) std::abort();
  if (huge) madvise(p, bytes, MADV_HUGEPAGE);
  return AlignedBytes(static_cast<char*>(p), AlignedFree{bytes, huge ? this : nullptr});
}

size_t BufferPool::pooled_bytes() {
  absl::MutexLock lock(&mu_);
  return pooled_;
}

void BufferPool::Free(char* p, size_t bytes) {
  // The pool keeps the newest freed buffers that fit: the oldest go to make
  // room, so that buffers of one size (two checkpoints written at once)
  // cannot keep another size's (a restore's) out for good.
  std::vector<char*> released;
  {
    absl::MutexLock lock(&mu_);
    if (bytes > capacity_) {
      released.push_back(p);
    } else {
      size_t oldest = 0;
      while (pooled_ + bytes > capacity_) {
        pooled_ -= free_[oldest].first;
        released.push_back(free_[oldest++].second);
      }
      free_.erase(free_.begin(), free_.begin() + static_cast<std::ptrdiff_t>(oldest));
      free_.emplace_back(bytes, p);
      pooled_ += bytes;
    }
  }
  for (char* r : released) std::free(r);
}

void AlignedFree::operator()(char* p) const {
  if (pool != nullptr) {
    pool->Free(p, bytes);
  } else {
    std::free(p);
  }
}

absl::StatusOr<std::unique_ptr<SequentialWriter>> SequentialWriter::Create(const std::string& path,
                                                                           WriteAt write_at) {
  const int fd = OpenMaybeDirect(path, O_WRONLY | O_CREAT | O_EXCL);
  if (fd < 0) {
    const int error = errno;  // before the message's allocation
    return ErrnoStatus(error, absl::StrCat("cannot create ", path));
  }
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
      // Taken before StopDirect's calls can change errno. No progress
      // without an error is what write(2) says of a full device.
      const int error = n < 0 ? errno : ENOSPC;
      if (n < 0 && error == EINTR) continue;
      // A file system that took the flag but wants larger blocks (or other
      // alignment) refuses the write: the rest goes through the page cache.
      if (n < 0 && error == EINVAL && StopDirect(fd_)) continue;
      if (n <= 0) status = ErrnoStatus(error, absl::StrCat("cannot write ", path_));
      done += n > 0 ? static_cast<size_t>(n) : 0;
    }
    mu_.Lock();
    if (error_.ok()) error_ = status;
    // A few buffers come back for reuse: their pages are already mapped.
    if (spare_.size() < 4) spare_.push_back(std::move(buffer));
  }
}

bool SequentialWriter::failed() {
  absl::MutexLock lock(&mu_);
  return !error_.ok();
}

absl::Status SequentialWriter::Close() {
  if (used_ > 0) Submit();
  {
    absl::MutexLock lock(&mu_);
    closing_ = true;
  }
  if (thread_.joinable()) thread_.join();
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    status = error_;
  }
  if (!status.ok()) return status;
  const char* failed = ftruncate(fd_, static_cast<off_t>(bytes_)) != 0 ? "truncate"
                       : fsync(fd_) != 0                                ? "fsync"
                                                                        : nullptr;
  if (failed != nullptr) {
    const int error = errno;  // before the message's allocation
    return ErrnoStatus(error, absl::StrCat("cannot ", failed, " ", path_));
  }
  return absl::OkStatus();
}

absl::Status ReadSequential(const std::string& path, uint64_t offset, uint64_t length,
                            const std::function<absl::Status(const char* data, size_t n)>& sink,
                            const DirectDestination& direct) {
  // O_DIRECT into a few reused buffers, and the sink copies out: the disk
  // then streams into memory already mapped, while the sink, on its own
  // thread, takes the page faults of wherever it copies to (a restore's
  // fresh state). Read through the page cache (readahead) straight into
  // fresh state, the same restore ran at a third to a half of the disk
  // here (docs/measurements.md, "Checkpoint write and restore").
  const int fd = OpenMaybeDirect(path, O_RDONLY);
  if (fd < 0) {
    return errno == ENOENT ? absl::NotFoundError(ErrnoText("cannot open", path))
                           : absl::DataLossError(ErrnoText("cannot open", path));
  }
  struct Piece {
    AlignedBytes buffer;
    const char* data = nullptr;  // in buffer: the piece's first byte
    size_t n = 0;
    absl::Status status;
  };
  std::mutex mu;
  std::condition_variable changed;
  std::deque<Piece> ready;  // these three under mu
  std::vector<AlignedBytes> spare;
  bool stop = false;
  for (size_t i = 0; i < kReadBuffers; ++i) spare.push_back(AllocateAligned(kReadBufferBytes));
  // The reader thread keeps the disk busy while the sink works: it reads a
  // piece into each spare buffer, and waits for one only when all of them
  // hold pieces the sink has not taken.
  std::thread reader([&] {
    for (uint64_t at = 0; at < length;) {
      Piece piece;
      size_t want = static_cast<size_t>(std::min<uint64_t>(kDirectChunkBytes, length - at));
      // Straight into the caller's memory, where everything is aligned: no
      // buffer and no copy (the sink is handed the bytes where they lie).
      char* to = nullptr;
      if (direct) {
        const auto [memory, room] = direct(at);
        if (memory != nullptr && (offset + at) % kDirectAlignment == 0 &&
            reinterpret_cast<uintptr_t>(memory) % kDirectAlignment == 0 && room >= kDirectAlignment &&
            room % kDirectAlignment == 0 && RoundUp(std::min<uint64_t>(want, room)) <= room) {
          to = memory;
        }
        if (room > 0) want = static_cast<size_t>(std::min<uint64_t>(want, room));
      }
      if (to == nullptr) {
        std::unique_lock<std::mutex> lock(mu);
        changed.wait(lock, [&] { return !spare.empty() || stop; });
        if (stop) return;
        piece.buffer = std::move(spare.back());
        spare.pop_back();
        to = piece.buffer.get();
      } else {
        std::unique_lock<std::mutex> lock(mu);
        if (stop) return;
      }
      // The piece's bytes within whole aligned blocks, as O_DIRECT reads
      // them: at most kDirectChunkBytes + 2 blocks, which a buffer holds.
      const uint64_t first = RoundDown(offset + at), end = RoundUp(offset + at + want);
      const size_t need = static_cast<size_t>(offset + at + want - first);
      size_t got = 0;
      while (got < need) {
        const size_t asked = static_cast<size_t>(end - first) - got;
        const ssize_t n = pread(fd, to + got, asked, static_cast<off_t>(first + got));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && errno == EINVAL && StopDirect(fd)) continue;  // the device wants larger blocks
        if (n < 0) piece.status = absl::DataLossError(ErrnoText("cannot read", path));
        if (n <= 0) break;
        got += static_cast<size_t>(n);
      }
      if (piece.status.ok() && got < need) {
        piece.status = absl::DataLossError(absl::StrCat(path, " is truncated: it ends before byte ", offset + length));
      }
      piece.data = to + (offset + at - first);
      piece.n = want;
      at += want;
      const bool last = !piece.status.ok();
      {
        std::lock_guard<std::mutex> lock(mu);
        ready.push_back(std::move(piece));
      }
      changed.notify_all();
      if (last) return;
    }
  });
  absl::Status status;
  for (uint64_t delivered = 0; delivered < length && status.ok();) {
    Piece piece;
    {
      std::unique_lock<std::mutex> lock(mu);
      changed.wait(lock, [&] { return !ready.empty(); });
      piece = std::move(ready.front());
      ready.pop_front();
    }
    status = piece.status;
    if (status.ok()) status = sink(piece.data, piece.n);
    delivered += piece.n;
    if (piece.buffer != nullptr) {
      std::lock_guard<std::mutex> lock(mu);
      spare.push_back(std::move(piece.buffer));
    }
    changed.notify_all();
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    stop = true;
  }
  changed.notify_all();
  reader.join();
  close(fd);
  return status;
}

}  // namespace shardopt::checkpoint
