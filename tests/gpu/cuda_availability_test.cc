// "No GPU" handling, which runs everywhere CUDA is built, GPU or not. The
// oracle for "is there a device" is the driver's device nodes, not the code
// under test.
#include <gtest/gtest.h>

#include <filesystem>
#include <regex>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/gpu.h"

namespace shardopt {
namespace {

bool DriverHasDevices() {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/dev", ec)) {
    if (std::regex_match(entry.path().filename().string(), std::regex("nvidia[0-9]+"))) return true;
  }
  return false;
}

TEST(CudaAvailabilityTest, NoDeviceMeansZeroGpusAndClearErrors) {
  if (DriverHasDevices()) GTEST_SKIP() << "this machine has NVIDIA device nodes";
  EXPECT_EQ(UsableGpuCount(), 0);
  EXPECT_FALSE(GpuUnavailableReason().empty());
  auto backend = MakeCudaBackend(0);
  ASSERT_FALSE(backend.ok());
  EXPECT_FALSE(backend.status().message().empty());
  auto bench = BenchCudaKernel(1 << 20, 0, 1);
  ASSERT_FALSE(bench.ok());
  EXPECT_FALSE(bench.status().message().empty());
}

TEST(CudaAvailabilityTest, ADeviceMeansABackend) {
  if (!DriverHasDevices()) GTEST_SKIP() << "this machine has no NVIDIA device nodes";
  ASSERT_GT(UsableGpuCount(), 0) << GpuUnavailableReason();
  auto backend = MakeCudaBackend(0);
  ASSERT_TRUE(backend.ok()) << backend.status();
  EXPECT_EQ((*backend)->Describe().rfind("cuda:0 (", 0), 0u) << (*backend)->Describe();
  EXPECT_TRUE(CudaBackendHealth(**backend).ok());
  // What the server's shardopt_device_memory_bytes reports.
  auto memory = CudaDeviceMemory(**backend);
  ASSERT_TRUE(memory.ok()) << memory.status();
  EXPECT_GT(memory->free, 0u);
  EXPECT_LE(memory->free, memory->total);
}

TEST(CudaAvailabilityTest, DevicesOutOfRangeFailCleanly) {
  for (int device : {-1, UsableGpuCount(), 1 << 20}) {
    auto backend = MakeCudaBackend(device);
    ASSERT_FALSE(backend.ok()) << device;
    EXPECT_FALSE(backend.status().message().empty());
  }
}

TEST(CudaAvailabilityTest, HealthOfANonCudaBackendIsOk) {
  EXPECT_TRUE(CudaBackendHealth(*MakeCpuBackend()).ok());
  // and it has no device memory to report.
  EXPECT_EQ(CudaDeviceMemory(*MakeCpuBackend()).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace shardopt
