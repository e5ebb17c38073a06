// BenchCudaKernel: the fused update against its roofline (DESIGN.md), a
// device-to-device copy moving the same bytes, measured in the same run.
#include <cuda_runtime_api.h>

#include "absl/functional/function_ref.h"
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
  if (auto st = device.Check(cudaEventCreate(&events.start), "cudaEventCreate"); !st.ok()) return st;
  if (auto st = device.Check(cudaEventCreate(&events.stop), "cudaEventCreate"); !st.ok()) return st;
  if (auto st = device.Check(cudaEventRecord(events.start, stream), "cudaEventRecord"); !st.ok()) return st;
  if (auto st = enqueue(); !st.ok()) return st;
  if (auto st = device.Check(cudaEventRecord(events.stop, stream), "cudaEventRecord"); !st.ok()) return st;
  if (auto st = device.Check(cudaEventSynchronize(events.stop), "cudaEventSynchronize"); !st.ok()) return st;
  float ms = 0;
  if (auto st = device.Check(cudaEventElapsedTime(&ms, events.start, events.stop), "cudaEventElapsedTime");
      !st.ok()) {
    return st;
  }
  return ms / 1e3;
}

}  // namespace

absl::StatusOr<GpuKernelBench> BenchCudaKernel(uint64_t elements, int device_index, int iterations) {
  if (elements == 0 || iterations <= 0) {
    return absl::InvalidArgumentError("the kernel benchmark needs elements and iterations above 0");
  }
  auto device = cuda::Device::Open(device_index);
  if (!device.ok()) return device.status();
  const cuda::Device& dev = **device;
  JobLayout layout;
  layout.shards = {{elements, Precision::kFp32}};
  auto job = cuda::CudaJobState::Create(*device, layout);
  if (!job.ok()) return job.status();
  cudaStream_t stream = (*job)->stream();
  // A GPU's speed does not depend on the values, but all-zero state would
  // reduce the update to p*decay; this byte makes every float and bf16 ~0.0115.
  const cuda::DeviceArray arena = (*job)->arena();
  if (auto st = dev.Check(cudaMemsetAsync(arena.base, 0x3C, (*job)->arena_bytes(), stream), "cudaMemsetAsync");
      !st.ok()) {
    return st;
  }
  // Step 1 of AdamW at lr 1e-3 with torch's defaults. Literal, because
  // step_scalars.cc lives in shardopt_kernels, which links this library.
  const math::AdamWScalars scalars{1.0f, 1.0f - 1e-5f, 0.1f, 0.999f, 0.001f, 0.0316227766f, 1e-2f, 1e-8f};
  const ShardStep step{{0, {0}}, scalars};
  // The first launch pays for module loading; it is not timed.
  if (auto st = (*job)->Apply({&step, 1}); !st.ok()) return st;
  auto update_seconds = Time(dev, stream, [&]() -> absl::Status {
    for (int i = 0; i < iterations; ++i) {
      if (auto st = (*job)->EnqueueApply({&step, 1}); !st.ok()) return st;
    }
    return absl::OkStatus();
  });
  if (!update_seconds.ok()) return update_seconds.status();

  const uint64_t copy_bytes = elements * kReadBytes;
  DeviceBuffer src, dst;
  if (auto st = dev.Check(cudaMalloc(&src.ptr, copy_bytes), "cudaMalloc"); !st.ok()) return st;
  if (auto st = dev.Check(cudaMalloc(&dst.ptr, copy_bytes), "cudaMalloc"); !st.ok()) return st;
  auto copy = [&]() -> absl::Status {
    return dev.Check(cudaMemcpyAsync(dst.ptr, src.ptr, copy_bytes, cudaMemcpyDeviceToDevice, stream),
                     "cudaMemcpyAsync device to device");
  };
  if (auto st = copy(); !st.ok()) return st;
  auto copy_seconds = Time(dev, stream, [&]() -> absl::Status {
    for (int i = 0; i < iterations; ++i) {
      if (auto st = copy(); !st.ok()) return st;
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
