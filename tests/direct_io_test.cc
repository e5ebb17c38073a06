// ReadSequential: the bytes of a range arrive whole and in order, from any
// offset to any end, and a short file is DATA_LOSS before the sink sees a
// short piece. SequentialWriter: a held-up disk
// holds the appender up, not its memory. BufferPool: freed buffers of whole
// huge pages come back, up to its capacity and no further.
#include "checkpoint/direct_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace shardopt::checkpoint {
namespace {

class DirectIoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() / ("shardopt-direct-io-" + std::to_string(getpid()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // A file of `n` random bytes, written with SequentialWriter.
  std::string WriteRandom(const std::string& name, size_t n) {
    bytes_.resize(n);
    std::mt19937_64 rng(n);
    for (char& c : bytes_) c = static_cast<char>(rng());
    const std::string path = (dir_ / name).string();
    auto writer = SequentialWriter::Create(path);
    EXPECT_TRUE(writer.ok()) << writer.status();
    (*writer)->Append(bytes_.data(), bytes_.size());
    EXPECT_TRUE((*writer)->Close().ok());
    return path;
  }

  std::filesystem::path dir_;
  std::string bytes_;
};

TEST_F(DirectIoTest, ARangeFromAnOddOffsetArrivesWholeInOrderCutAtWholeChunks) {
  // Three pieces' worth and a ragged end, read from an odd offset: every
  // read is of whole aligned blocks around the range.
  const size_t file_bytes = 3 * kDirectChunkBytes + 12345, offset = 777, length = file_bytes - offset - 5;
  const std::string path = WriteRandom("f", file_bytes);
  std::string got;
  bool cut_at_chunks = true;
  auto st = ReadSequential(path, offset, length, [&](const char* data, size_t n) {
    cut_at_chunks = cut_at_chunks && (n == kDirectChunkBytes || got.size() + n == length);
    got.append(data, n);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_TRUE(cut_at_chunks);
  ASSERT_EQ(got.size(), length);
  EXPECT_TRUE(got == bytes_.substr(offset, length));  // not EXPECT_EQ: gtest would diff 25 MB strings
}

// With a destination for part of the range (aligned memory, a whole
// number of blocks), those bytes are read straight into it and handed to
// the sink where they lie; the rest, and an offer that is not aligned,
// comes through the buffers. Every byte arrives once, in order, either way.
TEST_F(DirectIoTest, BytesWithADestinationAreReadStraightIntoItAndTheRestThroughBuffers) {
  const size_t offset = 2 * kDirectAlignment, length = 2 * kDirectChunkBytes + 5 * kDirectAlignment + 100;
  const std::string path = WriteRandom("direct", offset + length);
  // The destination takes data bytes [kDirectAlignment, + room), poisoned first.
  const size_t room = kDirectChunkBytes + 3 * kDirectAlignment;
  AlignedBytes memory = AllocateAligned(room);
  std::memset(memory.get(), 0x5A, room);
  for (const bool aligned : {true, false}) {
    SCOPED_TRACE(aligned ? "aligned" : "not aligned");
    char* const begin = memory.get() + (aligned ? 0 : 64);
    std::string got;
    size_t in_place = 0;
    auto st = ReadSequential(
        path, offset, length,
        [&](const char* data, size_t n) {
          if (data >= begin && data < begin + room) in_place += n;
          got.append(data, n);
          return absl::OkStatus();
        },
        [&](uint64_t at) -> std::pair<char*, uint64_t> {
          if (at < kDirectAlignment) return {nullptr, kDirectAlignment - at};  // a buffer's piece stops there
          if (at >= kDirectAlignment + room) return {nullptr, 0};
          return {begin + (at - kDirectAlignment), room - (at - kDirectAlignment) - (aligned ? 0 : 64)};
        });
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_EQ(got.size(), length);
    EXPECT_TRUE(got == bytes_.substr(offset, length));
    if (aligned) {
      EXPECT_EQ(in_place, room);
      EXPECT_TRUE(std::memcmp(memory.get(), bytes_.data() + offset + kDirectAlignment, room) == 0);
    } else {
      EXPECT_EQ(in_place, 0u);
    }
  }
}

// The last block of a file whose size is not a multiple of the block: a
// range ending at the file's end, and one ending a byte before it.
TEST_F(DirectIoTest, ARangeEndingInTheFilesLastPartialBlockArrivesWhole) {
  const size_t file_bytes = kDirectChunkBytes + 4097;
  const std::string path = WriteRandom("tail", file_bytes);
  for (size_t cut : {0, 1}) {
    std::string got;
    auto st = ReadSequential(path, 3, file_bytes - 3 - cut, [&](const char* data, size_t n) {
      got.append(data, n);
      return absl::OkStatus();
    });
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_TRUE(got == bytes_.substr(3, file_bytes - 3 - cut)) << "cut " << cut;
  }
}

TEST_F(DirectIoTest, AShortFileIsDataLossAndTheSinkNeverSeesAShortPiece) {
  const size_t file_bytes = kDirectChunkBytes + 1001;
  const std::string path = WriteRandom("short", file_bytes);
  size_t delivered = 0;
  bool whole_pieces = true;
  auto st = ReadSequential(path, 0, 2 * kDirectChunkBytes, [&](const char*, size_t n) {
    whole_pieces = whole_pieces && n == kDirectChunkBytes;
    delivered += n;
    return absl::OkStatus();
  });
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_NE(st.message().find("truncated"), std::string::npos) << st;
  EXPECT_TRUE(whole_pieces);
  EXPECT_EQ(delivered, kDirectChunkBytes);
}

TEST_F(DirectIoTest, TheSinksErrorStopsTheReadAndIsReturned) {
  const std::string path = WriteRandom("g", 4 * kDirectChunkBytes);
  int calls = 0;
  auto st = ReadSequential(path, 0, 4 * kDirectChunkBytes, [&](const char*, size_t) {
    ++calls;
    return absl::CancelledError("enough");
  });
  EXPECT_EQ(st.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(calls, 1);
}

// With the disk held up, Append stops once kQueuedBuffers full buffers wait
// behind the one being written, so a writer holds a few buffers whatever
// it is given; once the disk moves, everything arrives, in order. (The
// first writes are 1, 2 and 4 MiB, then 8: held up writing the first, the
// writer queues the next two and stops the appender in the fourth, 14 MiB
// in.)
TEST_F(DirectIoTest, AppendWaitsWhileTheDiskIsHeldUp) {
  std::mutex mu;
  std::condition_variable moved;
  bool held = true;
  const std::string path = (dir_ / "held").string();
  auto writer = SequentialWriter::Create(path, [&](int fd, const void* data, size_t n, off_t at) {
    std::unique_lock<std::mutex> lock(mu);
    moved.wait(lock, [&] { return !held; });
    return pwrite(fd, data, n, at);
  });
  ASSERT_TRUE(writer.ok()) << writer.status();
  constexpr size_t kBytes = size_t{64} << 20, kPiece = size_t{1} << 20;
  static_assert((SequentialWriter::kQueuedBuffers + 2) * kDirectChunkBytes <= kBytes / 2, "a few buffers");
  bytes_.resize(kBytes);
  std::mt19937_64 rng(5);
  for (char& c : bytes_) c = static_cast<char>(rng());
  std::atomic<size_t> appended{0};
  std::thread appender([&] {
    for (size_t at = 0; at < kBytes; at += kPiece) {
      (*writer)->Append(bytes_.data() + at, kPiece);
      appended += kPiece;
    }
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // ample for 64 MiB of copies
  EXPECT_LE(appended.load(), SequentialWriter::kQueuedBuffers * kDirectChunkBytes);
  {
    std::lock_guard<std::mutex> lock(mu);
    held = false;
  }
  moved.notify_all();
  appender.join();
  ASSERT_TRUE((*writer)->Close().ok());
  std::string read;
  ASSERT_TRUE(ReadSequential(path, 0, kBytes, [&](const char* p, size_t n) {
                read.append(p, n);
                return absl::OkStatus();
              }).ok());
  EXPECT_TRUE(read == bytes_);  // not EXPECT_EQ: gtest would diff 64 MB strings
}

// A failed write loses the file: the writer attempts no further write (the
// two buffers queued behind the failed one are dropped), the appender is
// not held up (all 64 MiB goes in), failed() says so (the snapshot stops
// streaming on it), and Close reports the error. That what
// comes after the failure is dropped rather than queued is not observable
// from outside, and not checked here.
TEST_F(DirectIoTest, AfterAFailedWriteNothingMoreIsWrittenAndCloseFails) {
  constexpr size_t kPiece = size_t{1} << 20;
  std::atomic<int> writes{0};
  std::atomic<size_t> appended{0};
  // The first write fails once the 2 and 4 MiB buffers queue behind it
  // (7 MiB appended: the ramp of AppendWaitsWhileTheDiskIsHeldUp).
  auto writer = SequentialWriter::Create((dir_ / "failing").string(), [&](int, const void*, size_t, off_t) {
    ++writes;
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (appended < 7 * kPiece && std::chrono::steady_clock::now() < give_up) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    errno = EIO;
    return ssize_t{-1};
  });
  ASSERT_TRUE(writer.ok()) << writer.status();
  const std::string piece(kPiece, 'x');
  for (int i = 0; i < 64; ++i) {
    (*writer)->Append(piece.data(), piece.size());
    appended += kPiece;
  }
  EXPECT_TRUE((*writer)->failed());
  const absl::Status closed = (*writer)->Close();
  EXPECT_EQ(closed.code(), absl::StatusCode::kInternal) << closed;
  EXPECT_NE(closed.message().find("cannot write"), std::string::npos) << closed;
  // The first write fails; those queued behind it before it failed are dropped.
  EXPECT_EQ(writes.load(), 1);
}

// A file system that accepts O_DIRECT on the descriptor but refuses the
// writes (EINVAL: it wants larger blocks) gets the same writes through the
// page cache, and the file is whole: as reads do.
TEST_F(DirectIoTest, WritesThatODirectRefusesGoThroughThePageCache) {
  const std::string path = (dir_ / "refusing").string();
  {
    // Where the file system has no O_DIRECT at all, the writer is buffered
    // from the start and there is nothing to fall back from.
    const int probe = open((dir_ / "probe").c_str(), O_WRONLY | O_CREAT | O_DIRECT, 0644);
    if (probe < 0) GTEST_SKIP() << "no O_DIRECT on " << dir_;
    close(probe);
  }
  std::atomic<int> refused{0};
  auto writer = SequentialWriter::Create(path, [&](int fd, const void* data, size_t n, off_t at) {
    const int flags = fcntl(fd, F_GETFL);
    if (flags >= 0 && (flags & O_DIRECT) != 0) {
      ++refused;
      errno = EINVAL;
      return ssize_t{-1};
    }
    return pwrite(fd, data, n, at);
  });
  ASSERT_TRUE(writer.ok()) << writer.status();
  std::string bytes(size_t{3} << 20 | 123, '\0');
  std::mt19937_64 rng(7);
  for (char& c : bytes) c = static_cast<char>(rng());
  (*writer)->Append(bytes.data(), bytes.size());
  ASSERT_TRUE((*writer)->Close().ok());
  EXPECT_EQ(refused.load(), 1);  // once; the descriptor is buffered from then on
  std::string back;
  ASSERT_TRUE(ReadSequential(path, 0, bytes.size(), [&](const char* data, size_t n) {
                back.append(data, n);
                return absl::OkStatus();
              }).ok());
  EXPECT_TRUE(back == bytes);
}

TEST(BufferPoolTest, TheNewestFreedHugePageBuffersComeBackUpToItsCapacity) {
  constexpr size_t kHuge = size_t{2} << 20;
  BufferPool pool(2 * kDirectChunkBytes);
  std::vector<AlignedBytes> held;
  for (int i = 0; i < 3; ++i) {
    held.push_back(pool.Allocate(kDirectChunkBytes));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(held.back().get()) % kHuge, 0u);
    std::memset(held.back().get(), 'a' + i, kDirectChunkBytes);  // each one's own bytes
  }
  EXPECT_EQ(pool.pooled_bytes(), 0u);
  char* const newest = held[2].get();
  held.clear();  // 0, 1 and 2 freed in that order: 0 goes to make room for 2
  EXPECT_EQ(pool.pooled_bytes(), 2 * kDirectChunkBytes);

  // Another size finds nothing to take; the asked size takes the newest.
  AlignedBytes other = pool.Allocate(kDirectChunkBytes + kHuge);
  EXPECT_EQ(pool.pooled_bytes(), 2 * kDirectChunkBytes);
  AlignedBytes again = pool.Allocate(kDirectChunkBytes);
  EXPECT_EQ(again.get(), newest);
  EXPECT_EQ(again[kDirectChunkBytes - 1], 'c');  // the same memory, not a copy
  EXPECT_EQ(pool.pooled_bytes(), kDirectChunkBytes);

  // Freed, the other size makes room by sending the oldest (buffer 1) away.
  other.reset();
  EXPECT_EQ(pool.pooled_bytes(), kDirectChunkBytes + kHuge);
  AlignedBytes last = pool.Allocate(kDirectChunkBytes);  // a new one: the pool holds the other size only
  EXPECT_EQ(pool.pooled_bytes(), kDirectChunkBytes + kHuge);

  // A buffer not of whole huge pages is never pooled.
  AlignedBytes small = pool.Allocate(kDirectAlignment);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(small.get()) % kDirectAlignment, 0u);
  small.reset();
  EXPECT_EQ(pool.pooled_bytes(), kDirectChunkBytes + kHuge);
}

}  // namespace
}  // namespace shardopt::checkpoint
