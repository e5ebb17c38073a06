#include "kernels/cuda/device.h"

#include <algorithm>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"

namespace shardopt::cuda {
namespace {

// Consumes the error, so that the next launch check does not see it again.
std::string ErrorText(const char* what, cudaError_t error) {
  cudaGetLastError();
  return absl::StrCat(what, ": ", cudaGetErrorName(error), " (", cudaGetErrorString(error), ")");
}

}  // namespace

absl::StatusOr<std::pair<uint64_t, uint64_t>> MemoryInfo(int device) {
  size_t free = 0, total = 0;
  cudaError_t e = cudaSetDevice(device);
  if (e == cudaSuccess) e = cudaMemGetInfo(&free, &total);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("cudaMemGetInfo: ", cudaGetErrorString(e)));
  }
  return std::make_pair(uint64_t{free}, uint64_t{total});
}

absl::StatusOr<int> VisibleDeviceCount() {
  int count = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&count); e != cudaSuccess) {
    return absl::UnavailableError(ErrorText("cudaGetDeviceCount", e));
  }
  return count;
}

absl::StatusOr<std::shared_ptr<Device>> Device::Open(int index) {
  const absl::StatusOr<int> count = VisibleDeviceCount();
  if (!count.ok()) return absl::FailedPreconditionError(absl::StrCat("no usable GPU: ", count.status().message()));
  if (index < 0 || index >= *count) {
    return absl::FailedPreconditionError(absl::StrCat("no CUDA device ", index, ": the runtime sees ", *count));
  }
  cudaDeviceProp prop;
  if (const cudaError_t e = cudaGetDeviceProperties(&prop, index); e != cudaSuccess) {
    return absl::FailedPreconditionError(absl::StrCat("cuda:", index, ": ", ErrorText("cudaGetDeviceProperties", e)));
  }
  // The build carries sm_80 and sm_90 code and sm_90 PTX: anything from 8.0 runs it.
  if (prop.major < 8) {
    return absl::FailedPreconditionError(absl::StrCat("cuda:", index, " (", prop.name, ") has compute capability ",
                                                      prop.major, ".", prop.minor, "; shardopt needs 8.0 or newer"));
  }
  std::shared_ptr<Device> device(new Device(index));
  device->description_ = absl::StrFormat("cuda:%d (%s, compute %d.%d, %d SMs, %.1f GiB)", index, prop.name,
                                         prop.major, prop.minor, prop.multiProcessorCount,
                                         static_cast<double>(prop.totalGlobalMem) / (1 << 30));
  SHARDOPT_RETURN_IF_ERROR(device->Enter());
  for (Slot& s : device->slots_) {
    SHARDOPT_RETURN_IF_ERROR(device->Check(cudaHostAlloc(reinterpret_cast<void**>(&s.pinned), kSlotBytes, cudaHostAllocDefault), "cudaHostAlloc"));
    SHARDOPT_RETURN_IF_ERROR(device->Check(cudaEventCreateWithFlags(&s.free, cudaEventDisableTiming), "cudaEventCreate"));
  }
  return device;
}

Device::~Device() {
  // Jobs hold the device and sync their streams when they go, so no copy
  // touches the slots any more. Errors here have nobody left to report to.
  cudaSetDevice(index_);
  for (Slot& s : slots_) {
    if (s.free != nullptr) cudaEventDestroy(s.free);
    if (s.pinned != nullptr) cudaFreeHost(s.pinned);
  }
  cudaGetLastError();
}

absl::Status Device::health() const {
  std::lock_guard<std::mutex> lock(health_mu_);
  return health_;
}

absl::Status Device::Enter() const {
  SHARDOPT_RETURN_IF_ERROR(health());
  return Check(cudaSetDevice(index_), "cudaSetDevice");
}

absl::Status Device::Check(cudaError_t error, const char* what) const {
  if (error == cudaSuccess) return absl::OkStatus();
  const std::string text = ErrorText(what, error);
  if (error == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(absl::StrCat("cuda:", index_, ": ", text));
  std::lock_guard<std::mutex> lock(health_mu_);
  if (health_.ok()) health_ = absl::UnavailableError(absl::StrCat("cuda:", index_, " is unusable after ", text));
  return health_;
}

absl::StatusOr<Device::Slot*> Device::TakeSlot() {
  Slot* slot = &slots_[next_slot_];
  next_slot_ = (next_slot_ + 1) % kSlots;
  SHARDOPT_RETURN_IF_ERROR(Check(cudaEventSynchronize(slot->free), "cudaEventSynchronize"));
  return slot;
}

absl::Status Device::Upload(cudaStream_t stream, absl::Span<const DeviceArray> dsts, uint64_t count,
                            absl::FunctionRef<void(uint64_t, uint64_t, char* const*)> fill) {
  uint64_t per_element = 0;
  for (const DeviceArray& d : dsts) per_element += d.elem_bytes;
  const uint64_t piece = kSlotBytes / per_element;
  std::vector<char*> staged(dsts.size());
  std::lock_guard<std::mutex> lock(staging_mu_);
  for (uint64_t first = 0; first < count; first += piece) {
    const uint64_t n = std::min(piece, count - first);
    SHARDOPT_ASSIGN_OR_RETURN(auto slot, TakeSlot());
    char* at = (slot)->pinned;
    for (size_t d = 0; d < dsts.size(); ++d) {
      staged[d] = at;
      at += n * dsts[d].elem_bytes;
    }
    fill(first, n, staged.data());
    for (size_t d = 0; d < dsts.size(); ++d) {
      const DeviceArray& dst = dsts[d];
      SHARDOPT_RETURN_IF_ERROR(Check(cudaMemcpyAsync(static_cast<char*>(dst.base) + first * dst.elem_bytes, staged[d], n * dst.elem_bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync to the device"));
    }
    SHARDOPT_RETURN_IF_ERROR(Check(cudaEventRecord((slot)->free, stream), "cudaEventRecord"));
  }
  return absl::OkStatus();
}

absl::Status Device::Download(cudaStream_t stream, DeviceArray src, uint64_t count,
                              absl::FunctionRef<void(uint64_t, uint64_t, const char*)> drain) {
  struct Piece {
    Slot* slot;
    uint64_t first;
    uint64_t n;
  };
  const uint64_t piece = kSlotBytes / src.elem_bytes;
  auto enqueue = [&](uint64_t first) -> absl::StatusOr<Piece> {
    const uint64_t n = std::min(piece, count - first);
    SHARDOPT_ASSIGN_OR_RETURN(auto slot, TakeSlot());
    SHARDOPT_RETURN_IF_ERROR(Check(cudaMemcpyAsync((slot)->pinned, static_cast<const char*>(src.base) + first * src.elem_bytes, n * src.elem_bytes, cudaMemcpyDeviceToHost, stream), "cudaMemcpyAsync to the host"));
    SHARDOPT_RETURN_IF_ERROR(Check(cudaEventRecord((slot)->free, stream), "cudaEventRecord"));
    return Piece{slot, first, n};
  };
  if (count == 0) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(staging_mu_);
  auto current = enqueue(0);
  while (current.ok()) {
    std::optional<absl::StatusOr<Piece>> next;
    if (const uint64_t end = current->first + current->n; end < count) {
      next = enqueue(end);
      if (!next->ok()) return next->status();
    }
    SHARDOPT_RETURN_IF_ERROR(Check(cudaEventSynchronize(current->slot->free), "cudaEventSynchronize"));
    drain(current->first, current->n, current->slot->pinned);
    if (!next) return absl::OkStatus();
    current = *std::move(next);
  }
  return current.status();
}

}  // namespace shardopt::cuda
