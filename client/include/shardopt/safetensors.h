// The safetensors file format (github.com/huggingface/safetensors): an
// 8-byte little-endian header length, a JSON header naming each tensor's
// dtype, shape and byte range, then the bytes. shardopt exports checkpoints
// to it and takes a job's initial values from it.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace shardopt {

struct SafetensorsTensor {
  std::string name;
  std::string dtype;  // "F32" or "BF16" are the ones shardopt writes and takes
  std::vector<uint64_t> shape;
  std::string data;   // little-endian elements
};

// Writes `tensors` in the order given, with `metadata` as __metadata__.
// INVALID_ARGUMENT, writing nothing, for what ReadSafetensors would refuse:
// a name given twice or named __metadata__, an unknown dtype, or data that
// is not its shape's size.
absl::Status WriteSafetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                              const std::map<std::string, std::string>& metadata);
// Reads a whole file into memory, its tensors sorted by name (the header is
// a JSON object, whose order a writer need not keep); INVALID_ARGUMENT naming
// what is wrong with a bad one, and, unread, a path that is not a regular
// file (a device or a pipe). `metadata`, if given, gets the file's
// __metadata__ (empty if it has none), such as the job and step that
// `shardopt export` records; it is left as it was if the read fails.
absl::StatusOr<std::vector<SafetensorsTensor>> ReadSafetensors(const std::string& path,
                                                               std::map<std::string, std::string>* metadata = nullptr);

}  // namespace shardopt
