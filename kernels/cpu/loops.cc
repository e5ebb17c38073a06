#include "kernels/cpu/loops.h"

namespace shardopt::cpu {
namespace generic { extern const LoopTable kLoops; }
namespace avx2 { extern const LoopTable kLoops; }
namespace avx512 { extern const LoopTable kLoops; }

const char* IsaName(Isa isa) {
  switch (isa) {
    case Isa::kGeneric: return "generic";
    case Isa::kAvx2: return "avx2";
    case Isa::kAvx512: return "avx512";
  }
  return "?";
}

std::vector<Isa> SupportedIsas() {
  std::vector<Isa> isas = {Isa::kGeneric};
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) isas.push_back(Isa::kAvx2);
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) {
    isas.push_back(Isa::kAvx512);
  }
  return isas;
}

Isa BestIsa() { return SupportedIsas().back(); }

const LoopTable& Loops(Isa isa) {
  switch (isa) {
    case Isa::kAvx2: return avx2::kLoops;
    case Isa::kAvx512: return avx512::kLoops;
    case Isa::kGeneric: break;
  }
  return generic::kLoops;
}

}  // namespace shardopt::cpu
