// A CPU shard's bf16 params, which a commit sends as they lie in memory
// (docs/design.md, section 10.2) rather than copying them into a message.
// They are kept in regions of kApplyAlignment elements, each shared with the
// commit streams that hold it (Hold), so that a region still being sent is
// never written: a write finds it shared and goes to a fresh copy of it
// (copy on write). Pieces of one step's commit never share a region, and a
// step starts applying only after every rank has received the last step's
// params, so in a normal run no copy is ever made; it is what keeps a slow
// sender's bytes intact.
//
// Not thread-safe: its job's lock guards it, except that holds may be
// released from any thread. Writers call PrepareWrite for a range (alone),
// then may write its elements from many threads.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"

namespace shardopt::cpu {

class ParamRegions {
 public:
  static constexpr uint64_t kRegion = kApplyAlignment;

  ParamRegions() = default;
  ParamRegions(ParamRegions&&) = default;
  ParamRegions& operator=(ParamRegions&&) = default;
  ParamRegions(const ParamRegions&) = delete;  // a copy would hold every region
  ParamRegions& operator=(const ParamRegions&) = delete;
  // `numel` params, zero.
  static absl::StatusOr<ParamRegions> Make(uint64_t numel);

  // Makes [offset, offset + count) writable: every region in it that is held
  // is replaced by a copy of its own.
  absl::Status PrepareWrite(uint64_t offset, uint64_t count);
  // Element `offset`, for writing up to the end of its region, after
  // PrepareWrite covered it.
  uint16_t* At(uint64_t offset) { return regions_[offset / kRegion].get() + offset % kRegion; }
  const uint16_t* At(uint64_t offset) const { return regions_[offset / kRegion].get() + offset % kRegion; }
  // Calls fn(params, first, n) for each run of [offset, offset + count) that
  // lies in one region: `params` holds elements first .. first + n - 1.
  // After PrepareWrite covered the range, the runs may be written.
  template <typename Fn>
  void ForEachRun(uint64_t offset, uint64_t count, Fn fn) {
    for (uint64_t at = offset; at < offset + count;) {
      const uint64_t n = std::min(offset + count, (at / kRegion + 1) * kRegion) - at;
      fn(At(at), at, n);
      at += n;
    }
  }
  // Copies [offset, offset + count) to `out`.
  void Read(uint64_t offset, uint64_t count, uint16_t* out) const;
  // [offset, offset + count) as it lies, held unchanged while the result's
  // owner lives.
  Pieces Hold(uint64_t offset, uint64_t count) const;
  uint64_t bytes() const { return numel_ * 2; }
  // What `numel` params take in memory: the small shards' regions are
  // rounded up to 64 bytes each, a large shard's mapping to its pages.
  static uint64_t HostBytes(uint64_t numel);
  // Makes the pages of [offset, offset + count) resident ahead of writes, as
  // JobState::Prefault; nothing for small shards, whose regions are touched
  // already.
  void Prefault(uint64_t offset, uint64_t count) const;

 private:
  // Shards of at least this many bytes of params have their regions carved
  // from one mapping (Make).
  static constexpr uint64_t kMappedBytes = uint64_t{2} << 20;

  // A region of `elements` params, 64-byte aligned and rounded up to 64
  // bytes, as the state's own buffers are.
  static uint64_t AllocatedBytes(uint64_t elements);
  static absl::StatusOr<std::shared_ptr<uint16_t>> NewRegion(uint64_t elements);
  uint64_t RegionLength(uint64_t r) const { return std::min(kRegion, numel_ - r * kRegion); }

  uint64_t numel_ = 0;
  std::vector<std::shared_ptr<uint16_t>> regions_;
  char* mapped_ = nullptr;  // the mapping the regions were carved from, if any
  uint64_t mapped_bytes_ = 0;
};

}  // namespace shardopt::cpu
