// A step's COMMIT is made once (checkpoint::PartWriter, through
// WriteFileNew): a writer that finds a peer's COMMIT of the same parts there
// reports the step complete without making it, and so does not prune after
// it; one that finds a COMMIT of other parts replaces it, as before. Two
// servers sharing a directory that tiled a step at the same moment used to
// both make it, and both prune the same old steps.

#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>

#include "checkpoint/catalog.h"
#include "checkpoint/format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace shardopt::checkpoint {
namespace {

std::string Contents(const std::string& path) {
  std::stringstream s;
  s << std::ifstream(path, std::ios::binary).rdbuf();
  return s.str();
}

class CommitTest : public ::testing::Test {
 protected:

  // The one part of job "j" (tensor a, 10 fp32 elements) at step 1, under
  // root_/`under`; `commit` (if given) is put in place as the step's COMMIT
  // after the part's data and before Finish, as a peer would.
  absl::StatusOr<WriteResult> WritePart(const std::string& under, const std::optional<std::string>& commit) {
    const v1::PartManifest m = Manifest();
    const std::string root = root_ + "/" + under;
    auto writer = PartWriter::Open(root, m);
    if (!writer.ok()) return writer.status();
    const std::string data(DataBytes(m), '\x01');
    (*writer)->Append(data.data(), data.size());
    commit_path_ = StepDirectory(root, "j", 1) + "/COMMIT";
    if (commit) std::ofstream(commit_path_, std::ios::binary) << *commit;
    return (*writer)->Finish();
  }

  static v1::PartManifest Manifest() {
    v1::PartManifest m;
    v1::CreateJobRequest* spec = m.mutable_spec();
    spec->set_job("j");
    spec->set_world_size(1);
    spec->add_groups();
    v1::TensorSpec* tensor = spec->add_tensors();
    tensor->set_name("a");
    tensor->set_numel(10);
    v1::ShardRange* r = spec->add_shards();
    r->set_tensor("a");
    r->set_offset(0);
    r->set_length(10);
    m.add_shards()->set_dtype(v1::FP32);
    m.set_step(1);
    return m;
  }

  testing::TempDir temp_;
  const std::string& root_ = temp_.path();
  std::string commit_path_;  // the last WritePart's
};

TEST_F(CommitTest, APeersCommitOfTheSamePartsIsTakenAndOneOfOtherPartsIsReplaced) {
  auto alone = WritePart("alone", std::nullopt);
  ASSERT_TRUE(alone.ok()) << alone.status();
  EXPECT_TRUE(alone->complete);
  EXPECT_TRUE(alone->committed_here);
  const std::string marker = Contents(commit_path_);
  ASSERT_FALSE(marker.empty());

  auto after_peer = WritePart("peer", marker);
  ASSERT_TRUE(after_peer.ok()) << after_peer.status();
  EXPECT_TRUE(after_peer->complete);
  EXPECT_FALSE(after_peer->committed_here);
  EXPECT_EQ(Contents(commit_path_), marker);

  auto over_other = WritePart("other", "a COMMIT of other parts");
  ASSERT_TRUE(over_other.ok()) << over_other.status();
  EXPECT_TRUE(over_other->complete);
  EXPECT_TRUE(over_other->committed_here);
  EXPECT_EQ(Contents(commit_path_), marker);
}

// Two servers sharing a directory by mistake, each holding a job of one
// name on one placement: the later writer of the part removes the earlier
// one's temporary (as one left by a writer that died), and the earlier one
// is told that, not "cannot rename ...: No such file or directory", which
// read as a missing directory (an outside probe). The later one completes.
TEST_F(CommitTest, AWriterWhoseTemporaryAnotherWriterOfThePartRemovedIsToldSo) {
  const v1::PartManifest m = Manifest();
  const std::string data(DataBytes(m), '\x01');
  auto first = PartWriter::Open(root_, m);
  ASSERT_TRUE(first.ok()) << first.status();
  (*first)->Append(data.data(), data.size());
  auto second = PartWriter::Open(root_, m);
  ASSERT_TRUE(second.ok()) << second.status();
  const auto refused = (*first)->Finish();
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_THAT(std::string(refused.status().message()),
              ::testing::HasSubstr("was removed while it was written, as only another writer of the same part does"));
  (*second)->Append(data.data(), data.size());
  const auto written = (*second)->Finish();
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_TRUE(written->complete);
}

}  // namespace
}  // namespace shardopt::checkpoint
