// The CUDA Backend. Internal to kernels/cuda/: the rest of the tree names it
// through kernels/gpu.h, which has no CUDA in it.
#pragma once

#include <memory>
#include <string>

#include "kernels/backend.h"
#include "kernels/cuda/device.h"

namespace shardopt::cuda {

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(std::shared_ptr<Device> device) : device_(std::move(device)) {}

  std::string Describe() const override { return device_->description(); }
  absl::StatusOr<std::unique_ptr<JobState>> Allocate(const JobLayout& layout) override;
  // The state is device memory; the pinned staging slots are the device's,
  // shared by every job.
  uint64_t HostBytes(const JobLayout&) const override { return 0; }

  const Device& device() const { return *device_; }

 private:
  std::shared_ptr<Device> device_;
};

}  // namespace shardopt::cuda
