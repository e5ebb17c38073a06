// checkpoint::DirectoryId: one id per directory, made once however many
// servers start on it at once, kept across restarts, and a file that is not
// an id refused rather than replaced.
#include "checkpoint/directory_id.h"

#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace shardopt::checkpoint {
namespace {

class DirectoryIdTest : public ::testing::Test {
 protected:
  testing::TempDir temp_;
  const std::string& dir_ = temp_.path();
};

TEST_F(DirectoryIdTest, EightServersStartingAtOnceGetOneIdWhichStaysAndAnotherDirectoryHasAnother) {
  std::vector<absl::StatusOr<std::string>> ids(8, absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  for (auto& id : ids) threads.emplace_back([&] { id = DirectoryId(dir_); });
  for (auto& t : threads) t.join();
  std::set<std::string> distinct;
  for (const auto& id : ids) {
    ASSERT_TRUE(id.ok()) << id.status();
    distinct.insert(*id);
  }
  ASSERT_EQ(distinct.size(), 1u);
  EXPECT_THAT(*ids[0], ::testing::MatchesRegex("[0-9a-f]{32}"));
  EXPECT_EQ(DirectoryId(dir_).value(), *ids[0]);  // a restart reads it
  // Nothing else is left beside it (each writer's temporary is gone).
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir_), {}), 1);
  testing::TempDir second;
  EXPECT_NE(DirectoryId(second.path()).value(), *ids[0]);
}

TEST_F(DirectoryIdTest, AFileThatIsNoIdIsRefusedAndLeftAsItIs) {
  const std::string path = dir_ + "/" + kDirectoryIdName;
  for (const std::string& text : {std::string(""), std::string("two\nlines\n"), std::string(65, 'a'),
                                  std::string(65, 'a') + "\n", std::string("with space\n"), std::string("\n")}) {
    std::ofstream(path, std::ios::trunc) << text;
    const auto id = DirectoryId(dir_);
    EXPECT_EQ(id.status().code(), absl::StatusCode::kFailedPrecondition) << text << " " << id.status();
    std::ifstream in(path);
    EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), text);
  }
  std::ofstream(path, std::ios::trunc) << "an-id-written-by-hand\n";
  EXPECT_EQ(DirectoryId(dir_).value(), "an-id-written-by-hand");
  std::ofstream(path, std::ios::trunc) << std::string(64, 'b');  // the longest, without a line's end
  EXPECT_EQ(DirectoryId(dir_).value(), std::string(64, 'b'));
}

// Before each checkpoint: an id file deleted with old checkpoints, or the
// directory deleted inside its volume, is written again with the id the
// server started with; a directory on another device than at start (its
// volume unmounted, or another mounted there; here a device number that is
// not the directory's) is refused, and nothing is written.
TEST_F(DirectoryIdTest, ACheckpointKeepsTheIdItStartedWithOnTheDeviceItStartedOn) {
  const std::string id = DirectoryId(dir_).value();
  const uint64_t device = DirectoryDevice(dir_).value();
  EXPECT_TRUE(KeepDirectoryId(dir_, id, device).ok());
  std::filesystem::remove(dir_ + "/" + kDirectoryIdName);
  EXPECT_TRUE(KeepDirectoryId(dir_, id, device).ok());
  EXPECT_EQ(DirectoryId(dir_).value(), id);
  std::filesystem::remove_all(dir_);
  EXPECT_TRUE(KeepDirectoryId(dir_, id, device).ok());
  EXPECT_EQ(DirectoryId(dir_).value(), id);
  std::filesystem::remove(dir_ + "/" + kDirectoryIdName);
  const absl::Status elsewhere = KeepDirectoryId(dir_, id, device + 1);
  EXPECT_EQ(elsewhere.code(), absl::StatusCode::kFailedPrecondition) << elsewhere;
  EXPECT_THAT(std::string(elsewhere.message()), ::testing::HasSubstr("is on another device than when this server started"));
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/" + kDirectoryIdName)) << "nothing written";
}

TEST_F(DirectoryIdTest, AnIdFileThatIsADirectoryIsSaidToBeNoFile) {
  std::filesystem::create_directory(dir_ + "/" + kDirectoryIdName);
  const auto id = DirectoryId(dir_);
  EXPECT_EQ(id.status().code(), absl::StatusCode::kFailedPrecondition) << id.status();
  EXPECT_THAT(std::string(id.status().message()), ::testing::HasSubstr("it is no file"));
}

}  // namespace
}  // namespace shardopt::checkpoint
