// BenchCudaKernel: the fused update against its roofline (docs/design.md,
// section 10.1), a device-to-device copy moving the same bytes, measured in
// the same run.
#include <cuda_runtime_api.h>

#include "absl/functional/function_ref.h"
#include "base/status_macros.h"
#include "kernels/cuda/job.h"
#include "kernels/gpu.h"

namespace shardopt {
namespace {

// Per element the update reads a bf16 gradient and fp32 p, m, v, and writes
// p, m, v and a bf16 param.
constexpr uint64_t kReadBytes = 2 + 12;
constexpr uint64_t kWriteBytes = 12 + 2;

class DeviceBuffer {
 public:
  ~DeviceBuffer() {
    if (ptr != nullptr) cudaFree(ptr);
  }
  void* ptr = nullptr;
};

class EventPair {
 public:
  ~EventPair() {
    if (start != nullptr) cudaEventDestroy(start);
    if (stop != nullptr) cudaEventDestroy(stop);
  }
  cudaEvent_t start = nullptr;
  cudaEvent_t stop = nullptr;
};

// Seconds between two events recorded around `enqueue`'s work on `stream`.
absl::StatusOr<double> Time(const cuda::Device& device, cudaStream_t stream,
                            absl::FunctionRef<absl::Status()> enqueue) {
  EventPair events;
  SHARDOPT_RETURN_IF_ERROR(device.Check(cudaEventCreate(&events.start), "cudaEventCreate"));
  SHARDOPT_RETURN_IF_ERROR(device.Check(cudaEventCreate(&events.stop), "cudaEventCreate"));
  SHARDOPT_RETURN_IF_ERROR(device.Check(cudaEventRecord(events.start, stream), "cudaEventRecord"));
  SHARDOPT_RETURN_IF_ERROR(enqueue());
  SHARDOPT_RETURN_IF_ERROR(device.Check(cudaEventRecord(events.stop, stream), "cudaEventRecord"));
  SHARDOPT_RETURN_IF_ERROR(device.Check(cudaEventSynchronize(events.stop), "cudaEventSynchronize"));
  float ms = 0;
  SHARDOPT_RETURN_IF_ERROR(device.Check(cudaEventElapsedTime(&ms, events.start, events.stop), "cudaEventElapsedTime"));
  return ms / 1e3;
}

}  // namespace

absl::StatusOr<GpuKernelBench> BenchCudaKernel(uint64_t elements, int device_index, int iterations) {
  if (elements == 0 || iterations <= 0) {
    return absl::InvalidArgumentError("the kernel benchmark needs elements and iterations above 0");
  }
  SHARDOPT_ASSIGN_OR_RETURN(auto device, cuda::Device::Open(device_index));
  const cuda::Device& dev = *device;
  JobLayout layout;
  layout.shards = {{elements, Precision::kFp32}};
  SHARDOPT_ASSIGN_OR_RETURN(auto job, cuda::CudaJobState::Create(device, layout));
  cudaStream_t stream = (job)->stream();
  // A GPU's speed does not depend on the values, but all-zero state would
  // reduce the update to p*decay; this byte makes every float and bf16 ~0.0115.
  const cuda::DeviceArray arena = (job)->arena();
  SHARDOPT_RETURN_IF_ERROR(dev.Check(cudaMemsetAsync(arena.base, 0x3C, (job)->arena_bytes(), stream), "cudaMemsetAsync"));
  // Step 1 of AdamW at lr 1e-3 with torch's defaults. Literal, because
  // step_scalars.cc lives in shardopt_kernels, which links this library.
  const math::AdamWScalars scalars{1.0f, 1.0f - 1e-5f, 0.1f, 0.999f, 0.001f, 0.0316227766f, 1e-2f, 1e-8f, 0.9f};
  const ShardStep step{{0, {0}}, scalars};
  // The first launch pays for module loading; it is not timed.
  SHARDOPT_RETURN_IF_ERROR((job)->Apply({&step, 1}));
  auto update_seconds = Time(dev, stream, [&]() -> absl::Status {
    for (int i = 0; i < iterations; ++i) {
      SHARDOPT_RETURN_IF_ERROR((job)->EnqueueApply({&step, 1}));
    }
    return absl::OkStatus();
  });
  if (!update_seconds.ok()) return update_seconds.status();

  const uint64_t copy_bytes = elements * kReadBytes;
  DeviceBuffer src, dst;
  SHARDOPT_RETURN_IF_ERROR(dev.Check(cudaMalloc(&src.ptr, copy_bytes), "cudaMalloc"));
  SHARDOPT_RETURN_IF_ERROR(dev.Check(cudaMalloc(&dst.ptr, copy_bytes), "cudaMalloc"));
  auto copy = [&]() -> absl::Status {
    return dev.Check(cudaMemcpyAsync(dst.ptr, src.ptr, copy_bytes, cudaMemcpyDeviceToDevice, stream),
                     "cudaMemcpyAsync device to device");
  };
  SHARDOPT_RETURN_IF_ERROR(copy());
  auto copy_seconds = Time(dev, stream, [&]() -> absl::Status {
    for (int i = 0; i < iterations; ++i) {
      SHARDOPT_RETURN_IF_ERROR(copy());
    }
    return absl::OkStatus();
  });
  if (!copy_seconds.ok()) return copy_seconds.status();

  GpuKernelBench result;
  result.elements_per_second = static_cast<double>(elements) * iterations / *update_seconds;
  result.copy_bytes_per_second = 2.0 * static_cast<double>(copy_bytes) * iterations / *copy_seconds;
  result.bytes_per_element = kReadBytes + kWriteBytes;
  return result;
}

}  // namespace shardopt
