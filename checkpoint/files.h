// The checkpoint's files below their layout: writes that leave a file whole
// or absent, ranged reads that name the file on failure, and the frame
// (magic, format version, manifest, crc32c) every file begins with.
// Internal to shardopt_checkpoint; checkpoint/format.h is the interface.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "base/whole_file.h"

namespace google::protobuf {
class Message;
}  // namespace google::protobuf

namespace shardopt::checkpoint {

inline constexpr char kCommitName[] = "COMMIT";

void PutU32(std::string* out, uint32_t v);
uint64_t GetLE(const char* p, int bytes);
// `what path: strerror(errno)`.
std::string ErrnoText(const std::string& what, const std::string& path);

// WriteFileWhole of dir/name (base/whole_file.h, which also has
// TemporaryName and FsyncDirectory): after a crash the file is either whole
// or absent.
absl::Status WriteFileAtomic(const std::string& dir, const std::string& name,
                             std::initializer_list<std::string_view> pieces);
// NOT_FOUND when the file is missing, DATA_LOSS when it is shorter.
absl::StatusOr<std::string> ReadRange(const std::string& path, uint64_t offset, uint64_t length);
absl::StatusOr<uint64_t> FileSize(const std::string& path);

// The frame around `message`, and back: ReadFrame checks it and returns its
// size, where a part's data begins.
std::string Frame(const google::protobuf::Message& message);
absl::StatusOr<uint64_t> ReadFrame(const std::string& path, google::protobuf::Message* message);

}  // namespace shardopt::checkpoint
