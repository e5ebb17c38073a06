// safetensors, export's and import's format: a round trip keeps every
// byte; the reserved __metadata__ name is refused on write; files whose
// tensors overlap, leave gaps or trailing bytes, or whose shape overflows
// are refused on read, naming why.
#include "shardopt/safetensors.h"

#include <sys/resource.h>
#include <unistd.h>

#include <csignal>

#include <cstdint>
#include <filesystem>
#include <map>
#include <fstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardopt {
namespace {

class SafetensorsTest : public ::testing::Test {
 protected:
  void TearDown() override { std::filesystem::remove(path_); }
  // A file of `header` (JSON, padded) followed by `data`.
  void WriteRaw(std::string header, const std::string& data) {
    header.append((8 - header.size() % 8) % 8, ' ');
    std::ofstream out(path_, std::ios::binary);
    const uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) out.put(static_cast<char>(n >> (8 * i)));
    out << header << data;
  }
  std::string Refusal(const std::string& header, const std::string& data) {
    WriteRaw(header, data);
    auto read = ReadSafetensors(path_);
    EXPECT_EQ(read.status().code(), absl::StatusCode::kInvalidArgument) << header;
    return std::string(read.status().message());
  }
  // A write to `path` of a new file that fails partway: a file-size limit
  // of 16 bytes stops it (SIGXFSZ ignored, so the write fails with EFBIG).
  static absl::Status WriteStoppedPartway(const std::string& path) {
    rlimit before;
    getrlimit(RLIMIT_FSIZE, &before);
    const auto handler = signal(SIGXFSZ, SIG_IGN);
    rlimit small = before;
    small.rlim_cur = 16;
    setrlimit(RLIMIT_FSIZE, &small);
    const absl::Status st = WriteSafetensors(path, {{"b", "F32", {2}, std::string(8, '\x05')}}, {});
    setrlimit(RLIMIT_FSIZE, &before);
    signal(SIGXFSZ, handler);
    return st;
  }
  const std::string path_ = std::filesystem::temp_directory_path() / ("shardopt-st-" + std::to_string(getpid()));
};

TEST_F(SafetensorsTest, ARoundTripKeepsEveryByte) {
  const std::vector<SafetensorsTensor> tensors = {{"a", "F32", {2, 3}, std::string("\x01\x02\x03\x04", 4) + std::string(20, '\x7f')},
                                                  {"b", "BF16", {5}, std::string(10, '\x33')}};
  ASSERT_TRUE(WriteSafetensors(path_, tensors, {{"step", "7"}, {"job", "j"}}).ok());
  std::map<std::string, std::string> metadata = {{"left", "over"}};
  auto read = ReadSafetensors(path_, &metadata);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(metadata, (std::map<std::string, std::string>{{"job", "j"}, {"step", "7"}}));
  // A read that fails, here past a header whose metadata parsed (a byte
  // after the data), leaves the map as it was.
  ASSERT_TRUE(WriteSafetensors(path_, tensors, {{"step", "8"}}).ok());
  std::ofstream(path_, std::ios::binary | std::ios::app) << 'x';
  ASSERT_FALSE(ReadSafetensors(path_, &metadata).ok());
  EXPECT_EQ(metadata, (std::map<std::string, std::string>{{"job", "j"}, {"step", "7"}}));
  // None written, none read (not what the map held before).
  ASSERT_TRUE(WriteSafetensors(path_, tensors, {}).ok());
  ASSERT_TRUE(ReadSafetensors(path_, &metadata).ok());
  EXPECT_TRUE(metadata.empty());
  ASSERT_EQ(read->size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ((*read)[i].name, tensors[i].name);
    EXPECT_EQ((*read)[i].dtype, tensors[i].dtype);
    EXPECT_EQ((*read)[i].shape, tensors[i].shape);
    EXPECT_EQ((*read)[i].data, tensors[i].data);
  }
}

// A write that fails partway leaves the file that was there as it was, not
// a truncated new one, and no temporary file beside it.
TEST_F(SafetensorsTest, AFailedWriteLeavesTheOldFileWhole) {
  const std::vector<SafetensorsTensor> old = {{"a", "F32", {1}, std::string("\x01\x02\x03\x04", 4)}};
  ASSERT_TRUE(WriteSafetensors(path_, old, {}).ok());
  const absl::Status st = WriteStoppedPartway(path_);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;  // as for a full disk
  EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr("File too large")) << "the reason the write failed";
  // Named by the file asked for first, not only by its temporary name.
  EXPECT_THAT(std::string(st.message()), ::testing::StartsWith("cannot write " + path_ + ": writing its temporary "))
      << st;
  // A directory that does not exist, the same way.
  const std::string nowhere = path_ + ".missing/out.safetensors";
  const absl::Status created = WriteSafetensors(nowhere, old, {});
  EXPECT_THAT(std::string(created.message()),
              ::testing::StartsWith("cannot write " + nowhere + ": creating its temporary " + nowhere + ".tmp."))
      << created;
  EXPECT_THAT(std::string(created.message()), ::testing::EndsWith(": No such file or directory")) << created;
  EXPECT_EQ(created.code(), absl::StatusCode::kFailedPrecondition) << created;
  for (const auto& entry : std::filesystem::directory_iterator(std::filesystem::path(path_).parent_path())) {
    EXPECT_NE(entry.path().string().rfind(path_ + ".tmp.", 0), 0u) << "left behind: " << entry.path();
  }
  auto read = ReadSafetensors(path_);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->size(), 1u);
  EXPECT_EQ((*read)[0].name, "a");
  EXPECT_EQ((*read)[0].data, old[0].data);
}

// Through a symlink, the link's target is replaced the same way, and the
// link kept: it used to be written in place, so a failed write left the
// target truncated.
TEST_F(SafetensorsTest, ASymlinksTargetIsReplacedWholeOrNotAtAll) {
  const std::string target = path_ + ".target";
  const std::vector<SafetensorsTensor> old = {{"a", "F32", {1}, std::string("\x01\x02\x03\x04", 4)}};
  ASSERT_TRUE(WriteSafetensors(target, old, {}).ok());
  std::filesystem::create_symlink(target, path_);
  const absl::Status st = WriteStoppedPartway(path_);
  EXPECT_EQ(st.code(), absl::StatusCode::kResourceExhausted) << st;
  auto read = ReadSafetensors(target);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ((*read)[0].data, old[0].data);

  ASSERT_TRUE(WriteSafetensors(path_, {{"b", "F32", {2}, std::string(8, '\x05')}}, {}).ok());
  EXPECT_TRUE(std::filesystem::is_symlink(path_));
  read = ReadSafetensors(target);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ((*read)[0].name, "b");
  // A link to no file yet is written through, the link kept.
  std::filesystem::remove(target);
  ASSERT_TRUE(WriteSafetensors(path_, old, {}).ok());
  EXPECT_TRUE(std::filesystem::is_symlink(path_));
  read = ReadSafetensors(target);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ((*read)[0].name, "a");
  std::filesystem::remove(target);
}

// As Python's reader refuses them: a tensor named twice (JSON kept the
// last, and the first's data was told as "a gap"), and metadata that is not
// text to text, as the format has it.
TEST_F(SafetensorsTest, ATensorNamedTwiceAndMetadataNotTextAreRefused) {
  const std::string entry = R"({"dtype":"F32","shape":[1],"data_offsets":[0,4]})";
  EXPECT_THAT(Refusal(R"({"tiny":)" + entry + R"(,"tiny":)" + entry + "}", std::string(4, '\0')),
              ::testing::HasSubstr("the header names 'tiny' twice"));
  EXPECT_THAT(Refusal(R"({"__metadata__":{"job":5},"tiny":)" + entry + "}", std::string(4, '\0')),
              ::testing::HasSubstr("__metadata__ must map text to text"));
  WriteRaw(R"({"__metadata__":{"job":"j"},"tiny":)" + entry + "}", std::string(4, '\0'));
  EXPECT_TRUE(ReadSafetensors(path_).ok());
  // A header padded with NUL bytes (the format pads with spaces): JSON holds
  // no raw NUL, and Python's reader refuses it; this one took the NUL as the
  // header's end.
  EXPECT_THAT(Refusal(R"({"tiny":)" + entry + "}" + std::string(3, '\0'), std::string(4, '\0')),
              ::testing::HasSubstr("NUL byte"));
  WriteRaw(R"({"tiny":)" + entry + "}   ", std::string(4, '\0'));  // spaces, as the format pads
  EXPECT_TRUE(ReadSafetensors(path_).ok());
}

TEST_F(SafetensorsTest, ADirectoryIsRefusedNotThrown) {
  const auto read = ReadSafetensors(std::filesystem::temp_directory_path().string());
  EXPECT_EQ(read.status().code(), absl::StatusCode::kInvalidArgument) << read.status();
}

// A device or a pipe is refused before it is read: /dev/zero took all
// memory (bad_alloc), a FIFO with no writer waited for good.
TEST_F(SafetensorsTest, AFileThatIsNotRegularIsRefusedUnread) {
  const auto read = ReadSafetensors("/dev/zero");
  EXPECT_EQ(read.status().code(), absl::StatusCode::kInvalidArgument) << read.status();
  EXPECT_THAT(std::string(read.status().message()), ::testing::HasSubstr("/dev/zero is not a regular file"));
}

TEST_F(SafetensorsTest, ATensorNamedLikeTheMetadataIsRefused) {
  const absl::Status st = WriteSafetensors(path_, {{"__metadata__", "F32", {1}, std::string(4, '\0')}}, {});
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
}

// What the reader would refuse is refused at the write, saying what is
// wrong (an unknown dtype read as "4 bytes are not its shape of Q7"), and no
// file is left; with no tensors and no metadata, the header is `{}`, which
// reads back as no tensors.
TEST_F(SafetensorsTest, WhatTheReaderRefusesIsNotWritten) {
  const std::vector<std::pair<std::vector<SafetensorsTensor>, std::string>> bad = {
      {{{"w", "F32", {1}, std::string(4, '\0')}, {"w", "F32", {1}, std::string(4, '\0')}}, "'w' is given twice"},
      {{{"w", "F32", {3}, std::string(8, '\0')}}, "tensor 'w': 8 bytes are not its shape of F32"},
      {{{"w", "Q7", {1}, std::string(4, '\0')}}, "tensor 'w' has dtype 'Q7', which safetensors does not know"},
      {{{"w", "F32", {uint64_t{1} << 62, 8}, std::string(4, '\0')}}, "tensor 'w': 4 bytes are not its shape"},
      {{{"w", "F32", {uint64_t{1} << 62, 8, 0}, ""}}, "tensor 'w': 0 bytes are not its shape"}};  // overflows, then 0
  for (const auto& [tensors, says] : bad) {
    const absl::Status st = WriteSafetensors(path_, tensors, {});
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << st;
    EXPECT_THAT(std::string(st.message()), ::testing::HasSubstr(says));
    EXPECT_FALSE(std::filesystem::exists(path_));
  }
  ASSERT_TRUE(WriteSafetensors(path_, {}, {}).ok());
  auto read = ReadSafetensors(path_);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_TRUE(read->empty());
}

// Each refusal names the tensor and says what is wrong with it (an
// unknown dtype read as "bytes do not hold its shape", an overlap named no
// tensor).
TEST_F(SafetensorsTest, DataThatDoesNotTileTheFileIsRefused) {
  const std::string eight(8, '\x11');
  EXPECT_THAT(Refusal(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                      R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", eight),
              ::testing::HasSubstr("the data of tensor 'b' begins at byte 4, inside the tensor before it"));
  EXPECT_THAT(Refusal(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", eight),
              ::testing::HasSubstr("the data of tensor 'a' begins at byte 4, after a gap"));
  EXPECT_THAT(Refusal(R"({"a":{"dtype":"Q7","shape":[2],"data_offsets":[0,8]}})", eight),
              ::testing::HasSubstr("entry 'a' has dtype 'Q7', which this reader does not know"));
  EXPECT_THAT(Refusal(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", eight),
              ::testing::HasSubstr("entry 'a' has data_offsets [8, 0), which end before they begin"));
  EXPECT_THAT(Refusal(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", eight),
              ::testing::HasSubstr("entry 'a' has data_offsets [0, 16), past the 8 bytes of data the file holds"));
  EXPECT_NE(Refusal(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", eight).find("after the last"),
            std::string::npos);
  EXPECT_NE(Refusal(R"({"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,0]}})", "")
                .find("past 2^64"), std::string::npos);
}

}  // namespace
}  // namespace shardopt
