#pragma once

#include <memory>

#include "kernels/backend.h"
#include "kernels/cpu/loops.h"

namespace shardopt {

struct CpuBackendOptions {
  int threads = 0;  // 0: one per core
  cpu::Isa isa = cpu::BestIsa();
};

std::unique_ptr<Backend> MakeCpuBackend(const CpuBackendOptions& options = {});

}  // namespace shardopt
