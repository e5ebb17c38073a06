// A part's manifest is checked before its sizes and ranges are used: a
// range outside its tensor, a section neither FP32 nor BF16, or sizes that
// wrap past 2^64 make the part DATA_LOSS (checkpoint::ReadPartHead, which
// every load and every listing of a step's parts goes through). A part
// whose sizes wrapped could otherwise tile its tensors, be committed, and
// send a restore into another placement reading far outside the file.
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/catalog.h"
#include "checkpoint/format.h"
#include "gtest/gtest.h"
#include "tests/testing/temp_dir.h"

namespace shardopt::checkpoint {
namespace {

class ManifestTest : public ::testing::Test {
 protected:

  // Writes a part of job `name` (tensors a and b of 10 elements) whose
  // sections are `sections`, appending as many data bytes as its manifest
  // says (DataBytes, which wraps as the manifest makes it), and returns the
  // status of reading its head back.
  absl::Status WriteAndReadBack(const std::string& name,
                                const std::vector<std::tuple<std::string, uint64_t, uint64_t, v1::DType>>& sections,
                                uint32_t group_of_a = 0) {
    v1::PartManifest m;
    v1::CreateJobRequest* spec = m.mutable_spec();
    spec->set_job(name);
    spec->set_world_size(1);
    spec->add_groups();
    for (const char* t : {"a", "b"}) {
      v1::TensorSpec* tensor = spec->add_tensors();
      tensor->set_name(t);
      tensor->set_numel(10);
    }
    spec->mutable_tensors(0)->set_group(group_of_a);
    for (const auto& [tensor, offset, length, dtype] : sections) {
      v1::ShardRange* r = spec->add_shards();
      r->set_tensor(tensor);
      r->set_offset(offset);
      r->set_length(length);
      m.add_shards()->set_dtype(dtype);
    }
    m.set_step(1);
    const uint64_t data_bytes = DataBytes(m);
    auto writer = PartWriter::Open(root_, m);
    if (!writer.ok()) return writer.status();
    (*writer)->Append(std::string(data_bytes, '\x01').data(), data_bytes);
    (*writer)->Finish().IgnoreError();  // the part is in place before the step's parts are listed
    std::string part;
    for (const auto& e : std::filesystem::recursive_directory_iterator(root_)) {
      if (e.path().filename().string().rfind("part-", 0) == 0) part = e.path().string();
    }
    if (part.empty()) return absl::NotFoundError("no part was written");
    return ReadPartHead(part).status();
  }

  testing::TempDir temp_;
  const std::string& root_ = temp_.path();
};

TEST_F(ManifestTest, AWholePartReadsBack) {
  EXPECT_TRUE(WriteAndReadBack("whole", {{"a", 0, 10, v1::FP32}, {"b", 0, 10, v1::BF16}}).ok());
}

TEST_F(ManifestTest, ARangePastItsTensorIsDataLoss) {
  const absl::Status st = WriteAndReadBack("past", {{"a", 5, 6, v1::FP32}});
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_NE(st.message().find("of tensor 'a'"), std::string::npos) << st;
}

TEST_F(ManifestTest, AnUnknownTensorIsDataLoss) {
  EXPECT_EQ(WriteAndReadBack("unknown", {{"c", 0, 10, v1::FP32}}).code(), absl::StatusCode::kDataLoss);
}

// export reads a job's configuration from its manifest alone: a group
// index past the groups is refused before anything looks it up.
TEST_F(ManifestTest, ATensorInAGroupThatIsNotThereIsDataLoss) {
  const absl::Status st = WriteAndReadBack("group", {{"a", 0, 10, v1::FP32}}, /*group_of_a=*/3);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
  EXPECT_NE(st.message().find("in group 3 of 1"), std::string::npos) << st;
}

TEST_F(ManifestTest, ASectionNeitherFp32NorBf16IsDataLoss) {
  EXPECT_EQ(WriteAndReadBack("dtype", {{"a", 0, 10, v1::DTYPE_UNSPECIFIED}}).code(), absl::StatusCode::kDataLoss);
}

// Temporary files of the part left by writers that died are removed, one
// under the very name this process would pick first (a server in a pod is
// always pid 1 and counts from 0 again) too: the part is written, not
// refused with "File exists".
TEST_F(ManifestTest, TemporariesOfDeadWritersAreRemovedAndNeverInTheWay) {
  const std::string dir = StepDirectory(root_, "stale", 1);
  std::filesystem::create_directories(dir);
  const std::vector<std::string> stale = {absl::StrCat(dir, "/part-0-0.bin.tmp.1.0"),
                                          absl::StrCat(dir, "/part-0-0.bin.tmp.", getpid(), ".0")};
  for (const std::string& path : stale) std::ofstream(path) << "left by a writer that died";
  ASSERT_TRUE(WriteAndReadBack("stale", {{"a", 0, 10, v1::FP32}, {"b", 0, 10, v1::FP32}}).ok());
  for (const std::string& path : stale) EXPECT_FALSE(std::filesystem::exists(path)) << path;
}

// A part that vanishes after its head was read (removed by hand, or by a
// peer's prune) is DATA_LOSS, not NOT_FOUND, which a restore takes for "no
// checkpoint" and then starts the job afresh.
TEST_F(ManifestTest, APartThatVanishesBeforeItsDataIsReadIsDataLoss) {
  ASSERT_TRUE(WriteAndReadBack("vanish", {{"a", 0, 10, v1::FP32}, {"b", 0, 10, v1::FP32}}).ok());
  std::string part;
  for (const auto& e : std::filesystem::recursive_directory_iterator(root_)) {
    if (e.path().filename().string().rfind("part-", 0) == 0) part = e.path().string();
  }
  auto head = ReadPartHead(part);
  ASSERT_TRUE(head.ok()) << head.status();
  std::filesystem::remove(part);
  const absl::Status st = StreamPartData(*head, [](uint64_t, const char*, size_t) { return absl::OkStatus(); });
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
}

// Offsets past 2^60 with lengths that wrap: the ranges of a tile it in
// uint64 arithmetic and the data bytes wrap to 240, what tensors of 10
// elements take. Read back, it is refused before anything is placed.
TEST_F(ManifestTest, RangesAndSizesThatWrapAreDataLoss) {
  constexpr uint64_t k60 = uint64_t{1} << 60;
  const absl::Status st = WriteAndReadBack(
      "wrap", {{"a", 0, k60, v1::FP32}, {"b", 0, 10, v1::FP32}, {"a", k60, 0 - k60 + 10, v1::FP32}});
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st;
}

}  // namespace
}  // namespace shardopt::checkpoint
