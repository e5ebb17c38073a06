// A sticky CUDA error (here a kernel that traps) makes the device unusable
// for the rest of the process. The backend must say so, with the error text,
// on every later call, and never abort. A binary of its own, because the
// context it breaks cannot be repaired. Skips without a GPU.
#include <gtest/gtest.h>

#include <vector>

#include "kernels/cuda/testing.h"
#include "kernels/gpu.h"

namespace shardopt {
namespace {

TEST(CudaStickyErrorTest, EveryLaterCallIsUnavailableWithTheErrorText) {
  if (UsableGpuCount() == 0) GTEST_SKIP() << "no GPU: " << GpuUnavailableReason();
  auto backend = MakeCudaBackend(0);
  ASSERT_TRUE(backend.ok()) << backend.status();
  JobLayout layout;
  layout.shards = {{1000, Precision::kFp32}};
  auto job = (*backend)->Allocate(layout);
  ASSERT_TRUE(job.ok()) << job.status();
  std::vector<uint16_t> grad(1000, 0x3F80);
  ASSERT_TRUE((*job)->WriteGrad(0, 0, 0, DType::kBf16, grad.data(), grad.size()).ok());
  EXPECT_TRUE(CudaBackendHealth(**backend).ok());

  const absl::Status broken = cuda_testing::BreakDevice(**backend);
  ASSERT_EQ(broken.code(), absl::StatusCode::kUnavailable) << broken;
  EXPECT_NE(broken.message().find("cuda"), absl::string_view::npos) << broken;
  EXPECT_EQ(CudaBackendHealth(**backend), broken);

  std::vector<float> out(1000);
  const std::vector<ShardGrads> grads = {{0, {0}}};
  const std::vector<ShardStep> steps = {{{0, {0}}, {}}};
  EXPECT_EQ((*job)->WriteGrad(0, 0, 0, DType::kBf16, grad.data(), grad.size()), broken);
  EXPECT_EQ((*job)->WriteState(0, StateKind::kMaster, 0, DType::kFp32, out.data(), out.size()), broken);
  EXPECT_EQ((*job)->ReadState(0, StateKind::kMaster, 0, out.size(), DType::kFp32, out.data()), broken);
  EXPECT_EQ((*job)->ReduceGrads(grads).status(), broken);
  EXPECT_EQ((*job)->Apply(steps), broken);
  EXPECT_EQ((*backend)->Allocate(layout).status(), broken);
  job->reset();  // tearing down on a broken device must not abort either
}

}  // namespace
}  // namespace shardopt
