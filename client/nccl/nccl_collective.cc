#include "shardopt/nccl_collective.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "client/nccl/widen.h"

namespace shardopt {
namespace {

absl::Status Check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

absl::Status Check(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", ncclGetErrorString(r)));
}

// Grows a device buffer to at least `count` elements.
template <typename T>
absl::Status Reserve(T** buffer, uint64_t* capacity, uint64_t count) {
  if (*capacity >= count) return absl::OkStatus();
  if (*buffer != nullptr) cudaFree(*buffer);
  *buffer = nullptr;
  *capacity = 0;
  SHARDOPT_RETURN_IF_ERROR(Check(cudaMalloc(reinterpret_cast<void**>(buffer), count * sizeof(T)), "cudaMalloc"));
  *capacity = count;
  return absl::OkStatus();
}

class NcclCollective final : public Collective {
 public:
  NcclCollective(ncclComm_t comm, cudaStream_t stream, int device, uint32_t rank, uint32_t size)
      : comm_(comm), stream_(stream), device_(device), rank_(rank), size_(size) {}
  ~NcclCollective() override {
    cudaSetDevice(device_);
    if (widened_ != nullptr) cudaFree(widened_);
    if (sums_ != nullptr) cudaFree(sums_);
    ncclCommDestroy(comm_);
    cudaStreamDestroy(stream_);
  }
  uint32_t rank() const override { return rank_; }
  uint32_t size() const override { return size_; }

  absl::Status ReduceScatter(const uint16_t* in, float* out, absl::Span<const FlatRange> ranges) override {
    if (ranges.size() != size_) return absl::InvalidArgumentError("one range per rank is needed");
    uint64_t n = 0;
    for (const FlatRange& r : ranges) n = std::max(n, r.end);
    SHARDOPT_RETURN_IF_ERROR(Enter());
    // The fp32 copy of the whole gradient: 4 B/param of device memory,
    // reused from step to step.
    SHARDOPT_RETURN_IF_ERROR(Reserve(&widened_, &widened_capacity_, n));
    SHARDOPT_RETURN_IF_ERROR(Check(nccl::WidenBf16(in, widened_, n, stream_), "widen bf16"));
    SHARDOPT_RETURN_IF_ERROR(Check(ncclGroupStart(), "ncclGroupStart"));
    for (uint32_t r = 0; r < size_; ++r) {
      if (ranges[r].size() == 0) continue;
      float* part = widened_ + ranges[r].begin;
      if (auto st = Check(ncclReduce(part, part, ranges[r].size(), ncclFloat32, ncclSum, static_cast<int>(r), comm_,
                                     stream_), "ncclReduce");
          !st.ok()) {
        ncclGroupEnd();
        return st;
      }
    }
    SHARDOPT_RETURN_IF_ERROR(Check(ncclGroupEnd(), "ncclGroupEnd"));
    const FlatRange mine = ranges[rank_];
    SHARDOPT_RETURN_IF_ERROR(Check(cudaMemcpyAsync(out, widened_ + mine.begin, mine.size() * sizeof(float), cudaMemcpyDeviceToHost, stream_), "copy sums to host"));
    return Check(cudaStreamSynchronize(stream_), "reduce-scatter");
  }

  absl::Status AllGather(uint16_t* data, absl::Span<const FlatRange> ranges) override {
    if (ranges.size() != size_) return absl::InvalidArgumentError("one range per rank is needed");
    SHARDOPT_RETURN_IF_ERROR(Enter());
    SHARDOPT_RETURN_IF_ERROR(Check(ncclGroupStart(), "ncclGroupStart"));
    for (uint32_t r = 0; r < size_; ++r) {
      if (ranges[r].size() == 0) continue;
      uint16_t* part = data + ranges[r].begin;
      if (auto st = Check(ncclBroadcast(part, part, ranges[r].size(), ncclBfloat16, static_cast<int>(r), comm_,
                                        stream_), "ncclBroadcast");
          !st.ok()) {
        ncclGroupEnd();
        return st;
      }
    }
    SHARDOPT_RETURN_IF_ERROR(Check(ncclGroupEnd(), "ncclGroupEnd"));
    return Check(cudaStreamSynchronize(stream_), "all-gather");
  }

  absl::Status AllReduceSum(double* data, uint64_t count) override {
    SHARDOPT_RETURN_IF_ERROR(Enter());
    SHARDOPT_RETURN_IF_ERROR(Reserve(&sums_, &sums_capacity_, count));
    const uint64_t bytes = count * sizeof(double);
    SHARDOPT_RETURN_IF_ERROR(Check(cudaMemcpyAsync(sums_, data, bytes, cudaMemcpyHostToDevice, stream_), "copy to device"));
    SHARDOPT_RETURN_IF_ERROR(Check(ncclAllReduce(sums_, sums_, count, ncclFloat64, ncclSum, comm_, stream_), "ncclAllReduce"));
    SHARDOPT_RETURN_IF_ERROR(Check(cudaMemcpyAsync(data, sums_, bytes, cudaMemcpyDeviceToHost, stream_), "copy to host"));
    return Check(cudaStreamSynchronize(stream_), "all-reduce");
  }

  absl::Status FromHost(const void* host_src, void* dst, uint64_t bytes) override {
    SHARDOPT_RETURN_IF_ERROR(Enter());
    // On the collective's own stream and waited for: a plain cudaMemcpy from
    // pageable memory may return before its last DMA lands, and the next
    // AllGather reads `dst` on stream_ with no other ordering against it.
    SHARDOPT_RETURN_IF_ERROR(
        Check(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_), "copy to device"));
    return Check(cudaStreamSynchronize(stream_), "copy to device");
  }

 private:
  // The calling thread may have another device current.
  absl::Status Enter() const { return Check(cudaSetDevice(device_), "cudaSetDevice"); }

  ncclComm_t comm_;
  cudaStream_t stream_;
  int device_;
  uint32_t rank_, size_;
  float* widened_ = nullptr;
  uint64_t widened_capacity_ = 0;
  double* sums_ = nullptr;
  uint64_t sums_capacity_ = 0;
};

}  // namespace

absl::StatusOr<NcclId> NewNcclId() {
  static_assert(sizeof(ncclUniqueId) == sizeof(NcclId), "NcclId must hold an ncclUniqueId");
  ncclUniqueId id;
  SHARDOPT_RETURN_IF_ERROR(Check(ncclGetUniqueId(&id), "ncclGetUniqueId"));
  NcclId out;
  std::memcpy(out.bytes, &id, sizeof id);
  return out;
}

absl::StatusOr<std::unique_ptr<Collective>> MakeNcclCollective(const NcclId& id, uint32_t rank, uint32_t size,
                                                               int device) {
  if (size == 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " is out of range for size ", size));
  }
  SHARDOPT_RETURN_IF_ERROR(Check(cudaSetDevice(device), "cudaSetDevice"));
  ncclUniqueId nid;
  std::memcpy(&nid, id.bytes, sizeof nid);
  ncclComm_t comm;
  SHARDOPT_RETURN_IF_ERROR(Check(ncclCommInitRank(&comm, static_cast<int>(size), nid, static_cast<int>(rank)), "ncclCommInitRank"));
  // A blocking stream: its work waits for what the legacy default stream
  // (PyTorch's default stream) queued before it, so ReduceScatter reads
  // gradients that backward has finished writing there.
  cudaStream_t stream;
  if (auto st = Check(cudaStreamCreateWithFlags(&stream, cudaStreamDefault), "cudaStreamCreate"); !st.ok()) {
    ncclCommDestroy(comm);
    return st;
  }
  return std::unique_ptr<Collective>(new NcclCollective(comm, stream, device, rank, size));
}

absl::StatusOr<DeviceBuffer> DeviceBuffer::Allocate(uint64_t bytes, int device) {
  SHARDOPT_RETURN_IF_ERROR(Check(cudaSetDevice(device), "cudaSetDevice"));
  DeviceBuffer b;
  SHARDOPT_RETURN_IF_ERROR(Check(cudaMalloc(&b.data_, std::max<uint64_t>(bytes, 1)), "cudaMalloc"));
  return b;
}

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept : data_(other.data_) { other.data_ = nullptr; }

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  std::swap(data_, other.data_);
  return *this;
}

DeviceBuffer::~DeviceBuffer() {
  if (data_ != nullptr) cudaFree(data_);
}

absl::Status DeviceBuffer::CopyToHost(void* host, uint64_t bytes) const {
  return Check(cudaMemcpy(host, data_, bytes, cudaMemcpyDeviceToHost), "copy to host");
}

absl::Status DeviceBuffer::CopyFromHost(const void* host, uint64_t bytes) {
  return Check(cudaMemcpy(data_, host, bytes, cudaMemcpyHostToDevice), "copy to device");
}

absl::StatusOr<int> CudaDeviceCount() {
  int n = 0;
  SHARDOPT_RETURN_IF_ERROR(Check(cudaGetDeviceCount(&n), "cudaGetDeviceCount"));
  return n;
}

}  // namespace shardopt
