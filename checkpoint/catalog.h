// A job's step directories, read: the parts a step holds, whether they
// tile every tensor, and which step is the newest complete checkpoint.
// Internal to shardopt_checkpoint; checkpoint/format.h is the interface.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "checkpoint/format.h"

namespace shardopt::checkpoint {

// OK when `b` is the job `a` is (placement, barrier deadline, restore step
// and group names aside, and a tensor's shape where one gives none), else FAILED_PRECONDITION naming `where` and the
// differences, `sides` saying whose value each shows first ("a's -> b's").
absl::Status SameJob(const v1::CreateJobRequest& a, const v1::CreateJobRequest& b, const std::string& where,
                     absl::string_view sides);
bool SameShards(const v1::CreateJobRequest& a, const v1::CreateJobRequest& b);
int TensorIndex(const v1::CreateJobRequest& spec, const std::string& name);
uint64_t DataBytes(const v1::PartManifest& m);

// A part file's manifest, and where and how big its data is.
struct PartHead {
  std::string path;
  v1::PartManifest manifest;
  uint64_t data_offset = 0;
  uint64_t file_bytes = 0;
  uint32_t data_crc = 0;  // as the trailer states it
};

absl::StatusOr<PartHead> ReadPartHead(const std::string& path);
// The parts' shard ranges of each tensor must tile it: sorted by offset, each
// begins where the previous ended. Returns whether they cover every tensor.
absl::StatusOr<bool> Tiles(const std::vector<PartHead>& parts);
std::vector<uint64_t> StepsNewestFirst(const std::string& job_dir);
// Streams a part's data to `sink` in ReadSequential's pieces, checking its
// crc32c as it goes; the mismatch, if any, is known after the last piece.
absl::Status StreamPartData(const PartHead& p, const DataSink& sink, const DirectDestination& direct = nullptr);
absl::StatusOr<std::string> ReadPartData(const PartHead& p);
bool IsPartName(const std::string& file);
// The file name of the part that a server with `spec`'s placement writes:
// "part-<tensor index>-<offset>.bin" of its first shard.
std::string PartName(const v1::CreateJobRequest& spec);
// Parts of a step that overlap this server's were left by a torn attempt
// with another placement; they are removed.
void RemoveOverlappingParts(const std::string& dir, const std::string& own, const v1::CreateJobRequest& spec);
// Temporary files of part `part` in `dir` ("<part>.tmp.*"), left by writers
// that died, are removed.
void RemoveTemporaries(const std::string& dir, const std::string& part);

struct Committed {
  std::string dir;
  v1::CommitMarker marker;
  std::vector<PartHead> parts;
};

// The complete checkpoint of `step`, or the newest one when step is 0.
absl::StatusOr<Committed> FindCommitted(const std::string& root, const std::string& job, uint64_t step,
                                        const Log& log);
// The trainers_per_rank its parts say (a node group's G), 0 where none says
// one: parts written by servers whose jobs plain clients made say 0.
uint32_t TrainersPerRank(const Committed& committed);

}  // namespace shardopt::checkpoint
