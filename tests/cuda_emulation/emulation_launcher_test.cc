// The host emulation's launcher itself: every thread of every block runs
// once, __syncthreads holds a block's threads in lockstep, and what the
// device would not run (a barrier some threads skip, a refused launch, a
// misaligned vector access) stops the test instead of passing.
#include <gtest/gtest.h>

#include <vector>

#include "kernels/cuda/emulation.h"
// After emulation.h: device code.
#include "kernels/cuda/emulated_kernels.h"
#include "kernels/cuda/kernel_args.h"

namespace shardopt::cuda {
namespace {

constexpr unsigned kBlock = 64;
constexpr unsigned kPoison = 0xDEADBEEFu;

// Each thread publishes a value and, after a barrier, reads its neighbour's;
// then the block folds the values pairwise, as the reduction kernel does.
// Were the threads not in lockstep, a thread would read a slot before its
// neighbour wrote it.
__global__ void RotateAndFold(unsigned* rotated, unsigned* folded) {
  __shared__ unsigned slots[kBlock];
  const unsigned t = threadIdx.x;
  slots[t] = blockIdx.x * 1000 + t;
  __syncthreads();
  const unsigned neighbour = slots[(t + 1) % blockDim.x];
  __syncthreads();  // every thread has read before any writes again
  slots[t] = neighbour;
  rotated[blockIdx.x * blockDim.x + t] = neighbour;
  __syncthreads();
  for (unsigned stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (t < stride) slots[t] += slots[t + stride];
    __syncthreads();
  }
  if (t == 0) folded[blockIdx.x] = slots[0];
}

TEST(EmulationLauncherTest, RunsEveryThreadOnceInLockstep) {
  constexpr unsigned kBlocks = 5;
  std::vector<unsigned> rotated(kBlocks * kBlock, kPoison), folded(kBlocks, kPoison);
  emulation::RunKernel(RotateAndFold, kBlocks, kBlock, rotated.data(), folded.data());
  for (unsigned b = 0; b < kBlocks; ++b) {
    for (unsigned t = 0; t < kBlock; ++t) {
      EXPECT_EQ(rotated[b * kBlock + t], b * 1000 + (t + 1) % kBlock) << "block " << b << " thread " << t;
    }
    EXPECT_EQ(folded[b], b * 1000 * kBlock + kBlock * (kBlock - 1) / 2) << "block " << b;
  }
}

__global__ void OneThreadSkipsTheBarrier() {
  if (threadIdx.x == 3) return;
  __syncthreads();
}

TEST(EmulationLauncherDeathTest, StopsAtABarrierNotEveryThreadReaches) {
  EXPECT_DEATH(emulation::RunKernel(OneThreadSkipsTheBarrier, 2, 32),
               "block 0: 1 of 32 threads ended while the others wait at __syncthreads");
}

TEST(EmulationLauncherDeathTest, StopsAtLaunchesTheDeviceRefuses) {
  EXPECT_DEATH(emulation::RunKernel(OneThreadSkipsTheBarrier, 0, 32),
               "0 blocks of 32 threads, which the device refuses");
  EXPECT_DEATH(emulation::RunKernel(OneThreadSkipsTheBarrier, 1, 1025), "1 blocks of 1025 threads");
}

// A task whose master starts 4 bytes past a 16-byte boundary, which the
// arena plan never makes and the device faults on: the emulated kernel's
// first vector load stops the process.
TEST(EmulationLauncherDeathTest, StopsAtAMisalignedVectorAccess) {
  // Two vectors' worth, so that the vector path runs however the tail is cut.
  constexpr uint64_t kN = 2 * kVec;
  alignas(16) float p[kN + kVec] = {}, m[kN] = {}, v[kN] = {};
  alignas(16) uint16_t grad[kN] = {}, out[kN] = {};
  Task task{};
  task.grad = grad;
  task.p = p + 1;
  task.m = m;
  task.v = v;
  task.param_out = out;
  task.numel = kN;
  task.rank_count = 1;
  const uint32_t rank = 0;
  Launch launch{};
  launch.tasks = &task;
  launch.ranks = &rank;
  launch.task_count = 1;
  launch.unit_count = 1;
  launch.bf16_grads = true;
  EXPECT_DEATH(emulated::LaunchUpdate(launch), "misaligned address");
}

}  // namespace
}  // namespace shardopt::cuda
