#include "kernels/cpu/aligned_buffer.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace shardopt::cpu {

absl::StatusOr<AlignedBuffer> AlignedBuffer::Zeroed(uint64_t bytes) {
  AlignedBuffer b;
  if (bytes == 0) return b;
  if (bytes >= kMapped) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      return absl::ResourceExhaustedError(absl::StrCat("cannot map ", bytes, " bytes of host memory"));
    }
    madvise(p, bytes, MADV_HUGEPAGE);
    b.data_ = static_cast<char*>(p);
    b.bytes_ = bytes;
    b.mapped_ = true;
    return b;
  }
  const uint64_t rounded = HostBytes(bytes);
  b.data_ = static_cast<char*>(std::aligned_alloc(64, rounded));
  if (b.data_ == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", bytes, " bytes of host memory"));
  }
  std::memset(b.data_, 0, rounded);
  b.bytes_ = bytes;
  return b;
}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& o) noexcept {
  std::swap(data_, o.data_);
  std::swap(bytes_, o.bytes_);
  std::swap(mapped_, o.mapped_);
  return *this;
}

AlignedBuffer::~AlignedBuffer() {
  if (mapped_) {
    munmap(data_, bytes_);
  } else {
    std::free(data_);
  }
}

uint64_t AlignedBuffer::HostBytes(uint64_t bytes) { return bytes < kMapped ? (bytes + 63) / 64 * 64 : WholePages(bytes); }

uint64_t AlignedBuffer::WholePages(uint64_t bytes) {
  const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}

}  // namespace shardopt::cpu
