// One GPU as the backend uses it: the latch that turns CUDA errors into
// statuses, and the pinned staging that every host<->device transfer goes
// through. Shared by the backend and its jobs, so it outlives both.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kernels/cuda/launch_plan.h"

namespace shardopt::cuda {

// Device memory seen as an array: element i of `elem_bytes` bytes at base + i*elem_bytes.
struct DeviceArray {
  void* base;
  uint64_t elem_bytes;
};

// The CUDA runtime's device count. Its error (no driver, no device) is
// returned as UNAVAILABLE with the runtime's text.
absl::StatusOr<int> VisibleDeviceCount();
// cudaMemGetInfo of `device`: free and total bytes. An error is cleared, so
// that no later launch check sees it.
absl::StatusOr<std::pair<uint64_t, uint64_t>> MemoryInfo(int device);

class Device {
 public:
  // Pinned staging: kSlots slots of kSlotBytes, 8 MiB per device whatever the
  // number of jobs. Two slots let the host fill one while the copy engine
  // drains the other; 4 MiB pieces keep the per-copy overhead small.
  static constexpr uint64_t kSlotBytes = kStagingSlotBytes;
  static constexpr int kSlots = 2;

  // Fails with FAILED_PRECONDITION when there is no usable device `index`.
  static absl::StatusOr<std::shared_ptr<Device>> Open(int index);
  ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  int index() const { return index_; }
  const std::string& description() const { return description_; }

  // Makes the device current on the calling thread. Once an error has
  // latched, every call fails with it.
  absl::Status Enter() const;
  // OK on success. An allocation failure is RESOURCE_EXHAUSTED and leaves the
  // device usable. Any other error is UNAVAILABLE and latches: it is either
  // sticky (the context is lost) or means device state is no longer what the
  // host believes, and serving wrong bits is worse than serving none.
  absl::Status Check(cudaError_t error, const char* what) const;
  absl::Status health() const;

  // Copies `count` elements host->device in pieces that fit one slot.
  // `fill(first, n, staged)` writes elements [first, first+n) of destination d
  // at staged[d]. Returns once the last piece is enqueued on `stream`: the
  // caller's buffer is free then, and stream order covers the rest.
  absl::Status Upload(cudaStream_t stream, absl::Span<const DeviceArray> dsts, uint64_t count,
                      absl::FunctionRef<void(uint64_t first, uint64_t n, char* const* staged)> fill);
  // Copies `count` elements device->host: piece k+1 is in flight while
  // `drain(first, n, staged)` consumes piece k. Returns when all are drained.
  absl::Status Download(cudaStream_t stream, DeviceArray src, uint64_t count,
                        absl::FunctionRef<void(uint64_t first, uint64_t n, const char* staged)> drain);

 private:
  struct Slot {
    char* pinned = nullptr;
    cudaEvent_t free = nullptr;  // recorded after the last copy that used the slot
  };

  explicit Device(int index) : index_(index) {}
  // The next slot of the ring, once its previous copy is done.
  absl::StatusOr<Slot*> TakeSlot();

  const int index_;
  std::string description_;
  mutable std::mutex health_mu_;
  mutable absl::Status health_;
  std::mutex staging_mu_;  // held for a whole transfer, so pieces stay in order
  std::array<Slot, kSlots> slots_;
  int next_slot_ = 0;
};

}  // namespace shardopt::cuda
