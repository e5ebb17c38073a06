// A write's failure carries a code a caller can act on (base/errno_status.h):
// the same errors reached through a real write as through the table.
#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>

#include <cerrno>
#include <filesystem>
#include <string>

#include "base/errno_status.h"
#include "base/whole_file.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardopt {
namespace {

using ::testing::HasSubstr;

TEST(ErrnoStatus, AFullDiskIsResourceExhaustedAMissingOrReadOnlyDirectoryFailedPreconditionTheRestInternal) {
  for (int error : {ENOSPC, EDQUOT, EFBIG, EMFILE, ENFILE}) EXPECT_EQ(ErrnoCode(error), absl::StatusCode::kResourceExhausted) << error;
  for (int error : {EROFS, EACCES, EPERM, ENOENT, ENOTDIR, EISDIR}) {
    EXPECT_EQ(ErrnoCode(error), absl::StatusCode::kFailedPrecondition) << error;
  }
  for (int error : {EIO, EEXIST, EINVAL, 0}) EXPECT_EQ(ErrnoCode(error), absl::StatusCode::kInternal) << error;
  const absl::Status st = ErrnoStatus(ENOSPC, "cannot write /x");
  EXPECT_EQ(st.message(), "cannot write /x: No space left on device");
}

// Through WriteFileWhole, past a file size limit (the one full-disk error a
// test can cause without privileges; SIGXFSZ ignored, as the server does)
// and into a directory that is not there.
TEST(ErrnoStatus, AWriteWholeThatFailsSaysWhyInItsCode) {
  char tmpl[] = "/tmp/shardopt-errno-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  rlimit before;
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &before), 0);
  const auto handler = signal(SIGXFSZ, SIG_IGN);
  rlimit small = before;
  small.rlim_cur = 16;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  const std::string data(64, 'x');
  const absl::Status too_large = WriteFileWhole(dir + "/f", {data});
  setrlimit(RLIMIT_FSIZE, &before);
  signal(SIGXFSZ, handler);
  EXPECT_EQ(too_large.code(), absl::StatusCode::kResourceExhausted) << too_large;
  EXPECT_THAT(std::string(too_large.message()), HasSubstr("File too large"));

  const absl::Status nowhere = WriteFileWhole(dir + "/gone/f", {data});
  EXPECT_EQ(nowhere.code(), absl::StatusCode::kFailedPrecondition) << nowhere;
  EXPECT_THAT(std::string(nowhere.message()), HasSubstr("No such file or directory"));
  EXPECT_TRUE(WriteFileWhole(dir + "/f", {data}).ok());
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace shardopt
