// The checkpoint format: how one server's part of a job's state at a step
// boundary goes to disk, how the parts of all servers become one complete
// checkpoint, and how any placement is read back from them. No JobStore here:
// JobStore snapshots and restores; this file only writes and reads bytes.
//
// Layout, under a root directory that every server of a job shares:
//   <root>/<job, %-escaped>/step-<step, 20 digits>/part-<tensor>-<offset>.bin
//   <root>/<job, %-escaped>/step-<step, 20 digits>/COMMIT
// A part file is
//   "SHOPTCK\n" | u32 format version | u64 manifest length L | PartManifest (L B)
//   | u32 crc32c of everything before it | zeros to a multiple of 4096 | data
//   | u32 crc32c of data
// (little-endian). The data holds, shard by shard in the manifest's order,
// master, m and v, each `length` elements of the shard's dtype followed by
// zeros to a multiple of 4096 bytes (format version 2; in version 1 there
// is no padding, and the arrays lie back to back from the frame's end).
// COMMIT is the same frame around a CommitMarker, with no data.
//
// Every file is written to a temporary name, fsynced, renamed, and then its
// directory is fsynced, so that a crash leaves either the whole file or none.
// A checkpoint is complete when its COMMIT exists; the server whose part
// makes the parts tile every tensor exactly writes it, after them.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "checkpoint/crc32c.h"
#include "checkpoint/direct_io.h"
#include "shardopt/v1/checkpoint.pb.h"

namespace shardopt::checkpoint {

namespace v1 = ::shardopt::v1;

// Version 2 pads the data's start and each array to kDirectAlignment
// (PartManifest.array_alignment). A version-1 reader must not take a
// version-2 part: it would read the padding as data, and the data's crc32c,
// which covers the padding, would still pass. Version 1 stays readable.
inline constexpr uint32_t kFormatVersion = 2;
inline constexpr uint32_t kOldestReadableFormatVersion = 1;


// One placement's state at one step: the manifest and its data, as laid out
// in a part file.
struct Part {
  v1::PartManifest manifest;
  std::string data;
};

// The data's layout, owned here alone: shard by shard in the manifest's
// order, a section of three arrays (master, m, v), each `length` elements of
// the shard's dtype (FP32, or BF16 for a BF16 group's state, exactly), and
// in version 2 each padded with zeros to a multiple of array_alignment.
enum class Array { kMaster = 0, kExpAvg = 1, kExpAvgSq = 2 };
inline constexpr Array kArrays[] = {Array::kMaster, Array::kExpAvg, Array::kExpAvgSq};

// `x` rounded up to a multiple of `alignment` (0 or 1: `x`).
inline uint64_t AlignUp(uint64_t x, uint64_t alignment) {
  return alignment <= 1 ? x : (x + alignment - 1) / alignment * alignment;
}
// Bytes of one element of a section of `dtype` (FP32, else BF16), of one of
// a shard's arrays, of the room an array takes with its padding (its
// stride), and of one shard's section (master, m and v).
inline uint64_t ElementBytes(v1::DType dtype) { return dtype == v1::FP32 ? 4 : 2; }
uint64_t ArrayBytes(const v1::PartManifest& m, int shard);
inline uint64_t ArrayStride(const v1::PartManifest& m, int shard) {
  return AlignUp(ArrayBytes(m, shard), m.array_alignment());
}
inline uint64_t SectionBytes(const v1::PartManifest& m, int shard) { return 3 * ArrayStride(m, shard); }
// Where each shard's section starts in the data; the last entry is its size.
std::vector<uint64_t> SectionOffsets(const v1::PartManifest& m);
inline uint64_t ArrayOffset(const std::vector<uint64_t>& sections, const v1::PartManifest& m, int shard, Array a) {
  return sections[shard] + static_cast<uint64_t>(a) * ArrayStride(m, shard);
}
// One array's elements in the on-disk dtype, from floats that the dtype holds
// exactly (a BF16 shard's state is bf16 values held as floats), and back.
// FP32 is the floats' own bytes, with no copy; BF16 is encoded into
// `scratch`, which the answer then points into.
std::string_view EncodeArray(const float* values, uint64_t count, v1::DType dtype, std::string* scratch);
void DecodeArray(const char* bytes, uint64_t count, v1::DType dtype, float* out);

// The job's directory under the root: its name %-escaped. It must fit in one
// file name (kMaxFileNameBytes); CreateJob refuses job names whose form does not.
std::string JobDirectoryName(const std::string& job);
std::string JobDirectory(const std::string& root, const std::string& job);
std::string StepDirectory(const std::string& root, const std::string& job, uint64_t step);
// Whether the step's COMMIT marker is there: its parts tile the job (a
// restore still checks them). A step without one is torn or being written.
bool StepCommitted(const std::string& root, const std::string& job, uint64_t step);
inline constexpr size_t kMaxFileNameBytes = 255;

struct WriteResult {
  std::string directory;
  uint64_t part_bytes = 0;
  bool complete = false;
  // This writer made the step's COMMIT. Servers sharing the directory that
  // tile a step at the same moment both find it complete; one makes COMMIT.
  bool committed_here = false;
  // Files of the step named as parts that could not be read (a stray or
  // damaged file), each with why: not counted towards COMMIT, which lists
  // only parts that were read, and left where they are.
  std::vector<std::string> passed_over;
};

// Writes one part into its step's directory as its data is appended, then
// writes COMMIT if the parts there now cover every tensor. The file goes out
// with O_DIRECT in large aligned writes on a thread of its own, its crc32c
// computed as the data comes; Append waits for the disk once a few buffers
// are queued (SequentialWriter), so do not append under a lock that others
// need. Finish refuses parts that overlap or disagree on the job's
// configuration, naming the files.
class PartWriter {
 public:
  // `written`: this very job (this run, this process) wrote its part of the
  // manifest's step whole already. If that file is still there, it is kept,
  // not written again (a round sealed since may have changed the manifest,
  // and a peer may have listed the file as it is), and Finish only writes
  // COMMIT if the parts now tile.
  // `array_alignment`: the data's start and each array's, padded with zeros
  // (PartManifest.array_alignment); kDirectAlignment, or 0 for none.
  // A step complete already whose part of this placement is of a life other
  // than the manifest's is refused (another run's), but for `read_from_life`,
  // the life of the parts the job's state was read from at this step (unset:
  // not restored from this step, or changed since; 0: parts of no life).
  // Where this placement has no part of the step, it is refused if no part
  // is of the manifest's life, unless the state was read from this step.
  static absl::StatusOr<std::unique_ptr<PartWriter>> Open(const std::string& root, v1::PartManifest manifest,
                                                          bool written = false,
                                                          uint32_t array_alignment = kDirectAlignment,
                                                          std::optional<uint64_t> read_from_life = std::nullopt);
  ~PartWriter();  // a part not finished leaves no file
  // False when there is no need to produce the data, which Append then
  // drops: the step's checkpoint is complete already, the part is kept, or
  // a write failed (Finish reports it).
  bool wants_data() const { return file_ != nullptr && !file_->failed(); }
  // The data, in the layout's order (SectionOffsets).
  void Append(const void* data, size_t n);
  absl::StatusOr<WriteResult> Finish();
  // Whether this part is in place under its name (written, or kept), even
  // if Finish then failed (a directory's fsync, COMMIT): a peer may have
  // listed it, so it must not be written over with other bytes.
  bool placed() const { return placed_; }

 private:
  PartWriter() = default;
  // Writes COMMIT if the step's parts, this one among them, tile every tensor.
  absl::StatusOr<WriteResult> CompleteIfTiled();
  // Appends n zero bytes: the frame's padding, or (`data`) an array's,
  // which the data's size and crc32c count.
  void Pad(uint64_t n, bool data);
  std::string root_, name_, tmp_;
  bool kept_ = false;    // the part is there already: nothing is written
  bool placed_ = false;  // see placed()
  v1::PartManifest manifest_;
  WriteResult result_;
  std::unique_ptr<SequentialWriter> file_;  // null once the step is complete already
  uint64_t frame_bytes_ = 0, data_bytes_ = 0;  // the frame with its padding; the data with the arrays'
  uint32_t crc_ = 0;
  size_t next_array_ = 0;    // the array Append is in, in the data's order
  uint64_t array_left_ = 0;  // its bytes still to come
};


// What a restore passed over and why, and what was set aside, for the
// server's log.
using Log = std::function<void(const std::string&)>;


// The state of `spec`'s placement (spec.shards) from the job's newest
// complete checkpoint, or from the one of `step` when step > 0, without
// holding the data in memory: `sink` gets every byte of it once, in pieces,
// as it is read. NOT_FOUND when there is none; DATA_LOSS for a corrupt file
// (a part or a COMMIT that is there but does not check out: the disk lost
// data, and no older state is put in its place unasked);
// FAILED_PRECONDITION for another format version or another configuration.
// Torn checkpoints (no COMMIT: not every part was written) are skipped when
// looking for the newest, and `log` is told why. A plain restart of the
// same placement streams its part file: the data in order from offset 0.
// Another placement streams each part it overlaps, whole (for its
// checksum), and gets the runs of those parts that fall in it, in the
// parts' order: each run is whole elements of one array, its pieces in
// order. Returns the manifest.
// A part's checksum is known only at its end: on an error the sink has seen
// data that must be thrown away.
// `begin` gets the manifest before any data, so that the sink knows the
// layout. A piece may end anywhere, inside an array's element too
// (ReadSequential's pieces end at multiples of 8 MiB of data, or where
// `direct` says).
using DataSink = std::function<absl::Status(uint64_t data_offset, const char* bytes, size_t n)>;
// `direct`, on a plain restart only: where the data's bytes may be read
// straight to (ReadSequential); the sink then gets them where they lie.
absl::StatusOr<v1::PartManifest> LoadInto(const std::string& root, const v1::CreateJobRequest& spec, uint64_t step,
                                          const Log& log,
                                          const std::function<absl::Status(const v1::PartManifest&)>& begin,
                                          const DataSink& sink, const DirectDestination& direct = nullptr);

// As LoadInto, from one part only, torn step or not: `spec`'s placement's
// part of `step`, which the life `life` wrote (CreateJobRequest.
// own_part_step). NOT_FOUND if there is no such part.
absl::StatusOr<v1::PartManifest> LoadOwnPart(const std::string& root, const v1::CreateJobRequest& spec, uint64_t step,
                                             uint64_t life, const std::function<absl::Status(const v1::PartManifest&)>& begin,
                                             const DataSink& sink, const DirectDestination& direct = nullptr);

// A complete checkpoint's step, its job configuration with every tensor
// whole as the placement, and that placement's state, as LoadInto finds and
// checks it: what export loads.
struct WholeJob {
  v1::CreateJobRequest spec;
  uint64_t step = 0;
  Part part;
};
absl::StatusOr<WholeJob> LoadWholeJob(const std::string& root, const std::string& job, uint64_t step,
                                      const Log& log);

}  // namespace shardopt::checkpoint
