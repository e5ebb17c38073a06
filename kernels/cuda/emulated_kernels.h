// kernels.h's launches with the kernels run on the CPU by the host emulation
// (emulation.h), for the tests on machines without a GPU. The memory the
// launch points at is host memory; each call returns once the grid has run.
#pragma once

#include "kernels/cuda/kernel_args.h"

namespace shardopt::cuda::emulated {

void LaunchUpdate(const Launch& launch);
void LaunchReduce(const Launch& launch);

}  // namespace shardopt::cuda::emulated
