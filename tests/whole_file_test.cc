// WriteFileNew, which makes a checkpoint step's COMMIT: of writers racing
// for one name, exactly one makes the file, whole, and the others are told
// ALREADY_EXISTS and change nothing. Two servers sharing a checkpoint
// directory that tiled a step at the same moment both made COMMIT (by a
// rename, which replaces), and both then pruned the same old steps.
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/whole_file.h"
#include "gtest/gtest.h"

namespace shardopt {
namespace {

std::string Contents(const std::string& path) {
  std::stringstream s;
  s << std::ifstream(path).rdbuf();
  return s.str();
}

TEST(WholeFile, OfTwoWritersAtOnceExactlyOneMakesTheFileAndTheOtherChangesNothing) {
  char tmpl[] = "/tmp/shardopt-whole-file-XXXXXX";
  const std::string dir = mkdtemp(tmpl);
  for (int round = 0; round < 100; ++round) {
    const std::string path = absl::StrCat(dir, "/COMMIT-", round);
    absl::Status made[2];
    std::vector<std::thread> writers;
    for (int w = 0; w < 2; ++w) {
      writers.emplace_back([&, w] { made[w] = WriteFileNew(path, {absl::StrCat("writer ", w, " of round ", round)}); });
    }
    for (auto& t : writers) t.join();
    ASSERT_NE(made[0].ok(), made[1].ok()) << "round " << round << ": " << made[0] << " / " << made[1];
    const int winner = made[0].ok() ? 0 : 1;
    EXPECT_TRUE(absl::IsAlreadyExists(made[1 - winner])) << made[1 - winner];
    EXPECT_EQ(Contents(path), absl::StrCat("writer ", winner, " of round ", round));
  }
  // A name taken earlier stays as it was; no temporary is left behind.
  EXPECT_TRUE(absl::IsAlreadyExists(WriteFileNew(dir + "/COMMIT-0", {"late"})));
  EXPECT_NE(Contents(dir + "/COMMIT-0"), "late");
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    EXPECT_EQ(entry.path().filename().string().find(".tmp."), std::string::npos) << entry.path();
    ++files;
  }
  EXPECT_EQ(files, 100);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace shardopt
