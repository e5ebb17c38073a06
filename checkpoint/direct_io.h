// Large sequential file I/O at the disk's speed, with a thread that keeps
// the disk busy while the caller fills or drains the next buffer. Reads and
// writes use O_DIRECT (no copy through the page cache, no cache to evict)
// into and from aligned buffers; a file system that refuses it gets the
// same calls buffered.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace shardopt::checkpoint {

// The unit of O_DIRECT offsets and sizes, and the buffers' alignment.
inline constexpr size_t kDirectAlignment = 4096;
// Bytes per write or read call: large enough that the disk streams.
inline constexpr size_t kDirectChunkBytes = size_t{8} << 20;

class BufferPool;
struct AlignedFree {
  size_t bytes = 0;
  BufferPool* pool = nullptr;  // where the buffer goes back to, if anywhere
  void operator()(char* p) const;
};
using AlignedBytes = std::unique_ptr<char[], AlignedFree>;

// Aligned buffers for O_DIRECT. A buffer of whole huge pages, once freed,
// waits in its pool (the newest freed, up to the pool's capacity) for the
// next writer or reader that asks for its size: memory the process maps
// afresh costs this VM a host fault per page on first touch (0.4 GB/s,
// against 10-19 GB/s for memory mapped before), and a checkpoint whose
// buffers were mapped anew each time took about 15% longer to write here
// (README, "Write at the disk's speed").
class BufferPool {
 public:
  explicit BufferPool(size_t capacity_bytes) : capacity_(capacity_bytes) {}
  ~BufferPool();
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // The pool every writer and reader here takes from: room for one writer's
  // and one reader's buffers (SequentialWriter::kMostBytes and
  // kReadBuffers x kReadBufferBytes). Never destroyed.
  static BufferPool& Default();

  // A buffer of `bytes`, aligned for O_DIRECT (to a huge page when it is
  // whole huge pages): the last one freed of that size, else a new one.
  AlignedBytes Allocate(size_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  // The bytes of the freed buffers it holds.
  size_t pooled_bytes() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  friend struct AlignedFree;
  void Free(char* p, size_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

  const size_t capacity_;
  absl::Mutex mu_;
  std::vector<std::pair<size_t, char*>> free_ ABSL_GUARDED_BY(mu_);  // newest last
  size_t pooled_ ABSL_GUARDED_BY(mu_) = 0;
};

inline AlignedBytes AllocateAligned(size_t bytes) { return BufferPool::Default().Allocate(bytes); }

// Writes one new file sequentially: Append copies into aligned buffers, and
// the writer thread writes each full one while the caller fills the next.
// At most kQueuedBuffers full buffers wait for the disk: Append then waits
// for one to be written, so a writer holds a few buffers whatever the
// file's size (do not append under a lock that the disk's pace would hold
// up). Close writes the rest, cuts the file to its exact size and fsyncs it.
class SequentialWriter {
 public:
  // Enough to keep the disk busy while the caller fills the next buffer;
  // with the one being filled and the one being written, a writer holds at
  // most (kQueuedBuffers + 2) x kDirectChunkBytes.
  static constexpr size_t kQueuedBuffers = 2;
  static constexpr size_t kMostBytes = (kQueuedBuffers + 2) * kDirectChunkBytes;

  // What writes a buffer at an offset of the file: pwrite, unless a test
  // holds the disk up through it.
  using WriteAt = std::function<ssize_t(int fd, const void* data, size_t n, off_t at)>;
  // Creates `path` (O_EXCL: it must not exist).
  static absl::StatusOr<std::unique_ptr<SequentialWriter>> Create(const std::string& path, WriteAt write_at = nullptr);
  ~SequentialWriter();  // stops the thread; a file not closed is left for the caller to remove

  void Append(const void* data, size_t n);
  // Whether a write has failed: the file is lost, Append drops what it is
  // given, and Close reports the error.
  bool failed() ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Close();

 private:
  // The first write; a multiple of kDirectAlignment.
  static constexpr size_t kFirstWriteBytes = size_t{1} << 20;

  SequentialWriter(int fd, std::string path, WriteAt write_at);
  void Run();
  void Submit();

  const int fd_;
  const std::string path_;
  const WriteAt write_at_;
  uint64_t bytes_ = 0;
  AlignedBytes current_;
  size_t used_ = 0;
  // Bytes the current buffer takes before it is written: the first writes
  // are small, so that the disk starts after a MiB of copies rather than
  // 8, then they double up to kDirectChunkBytes.
  size_t fill_ = kFirstWriteBytes;

  absl::Mutex mu_;
  std::deque<std::pair<AlignedBytes, size_t>> queue_ ABSL_GUARDED_BY(mu_);
  std::vector<AlignedBytes> spare_ ABSL_GUARDED_BY(mu_);
  bool closing_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  uint64_t written_ ABSL_GUARDED_BY(mu_) = 0;  // file offset of the next write
  std::thread thread_;
};

// Reads [offset, offset+length) of `path` in order, handing `sink` the
// bytes in pieces of at most kDirectChunkBytes: without `direct`, pieces
// that end at multiples of kDirectChunkBytes of the range (so a piece may
// end inside an element: the sink keeps what it needs); with it, pieces
// that also end where `direct` says (DirectDestination). The reads are
// O_DIRECT in whole aligned blocks into kReadBuffers buffers of its own, or
// straight into a destination, and the reader goes on while the sink works. DATA_LOSS if the
// file is shorter, and the sink never gets a short piece; the sink's error
// stops the read and is returned.
inline constexpr size_t kReadBuffers = 3;
// A piece and the aligned blocks around it, in whole huge pages.
inline constexpr size_t kReadBufferBytes = kDirectChunkBytes + (size_t{2} << 20);
// Where the range's bytes from `at` on may be read straight to, and how many
// of them: memory of the caller's that is the bytes' destination anyway (a
// restore's state). Used where the file offset, the memory and the room
// are all multiples of kDirectAlignment; the piece then ends within the
// room, and the sink gets it where it was read. {nullptr, n}: the next n
// bytes have no destination, and go through a buffer in pieces that end
// there (so that a destination after them is not read past); n = 0: no
// end is known.
using DirectDestination = std::function<std::pair<char*, uint64_t>(uint64_t at)>;
absl::Status ReadSequential(const std::string& path, uint64_t offset, uint64_t length,
                            const std::function<absl::Status(const char* data, size_t n)>& sink,
                            const DirectDestination& direct = nullptr);

}  // namespace shardopt::checkpoint
