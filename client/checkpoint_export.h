// `shardopt export`: a complete checkpoint's masters, read from disk with no
// server, written to a safetensors file.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"

namespace shardopt {

// Writes job `job`'s masters from the complete checkpoint of `step` (0: the
// newest) under `dir` to `out`: fp32 exactly, or rounded to bf16 (warning on
// stderr of finite masters that round to infinity), each in the shape the
// job gave it. INVALID_ARGUMENT for an `out` inside the job's checkpoints
// (through any symlinks); a read that a prune cut short is tried again on
// the newest. Says what it wrote on stdout.
absl::Status ExportCheckpoint(const std::string& dir, uint64_t step, bool bf16, const std::string& job,
                              const std::string& out);

}  // namespace shardopt
