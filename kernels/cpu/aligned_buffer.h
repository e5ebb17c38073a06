// A CPU shard's zeroed host buffer (master, m, v, a gradient slot): small
// ones 64-byte aligned from the heap, large ones fresh anonymous mappings.
// HostBytes says what one takes, so that the budget charges what is
// allocated (CpuBackend::HostBytes).
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"

namespace shardopt::cpu {

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // Large buffers are fresh anonymous mappings: the kernel's zero pages,
  // touched first by whatever writes the state (Init, or a restore), not by
  // a memset here too; huge pages where the kernel grants them cut the page
  // faults 512-fold.
  static absl::StatusOr<AlignedBuffer> Zeroed(uint64_t bytes);
  AlignedBuffer(AlignedBuffer&& o) noexcept : data_(o.data_), bytes_(o.bytes_), mapped_(o.mapped_) {
    o.data_ = nullptr;
    o.bytes_ = 0;
    o.mapped_ = false;
  }
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer();

  char* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }
  bool mapped() const { return mapped_; }
  // What Zeroed(bytes) takes: a mapping of whole pages, or an allocation
  // rounded up to 64 bytes.
  static uint64_t HostBytes(uint64_t bytes);
  // `bytes` rounded up to whole pages, as a mapping of them takes.
  static uint64_t WholePages(uint64_t bytes);

 private:
  static constexpr uint64_t kMapped = uint64_t{2} << 20;
  char* data_ = nullptr;
  uint64_t bytes_ = 0;
  bool mapped_ = false;
};

}  // namespace shardopt::cpu
