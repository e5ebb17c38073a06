#include "kernels/backend.h"

namespace shardopt {

const char* PrecisionName(Precision p) { return p == Precision::kFp32 ? "FP32" : "BF16"; }
const char* DTypeName(DType d) { return d == DType::kFp32 ? "fp32" : "bf16"; }
const char* StateKindName(StateKind k) {
  switch (k) {
    case StateKind::kMaster: return "master";
    case StateKind::kExpAvg: return "exp_avg";
    case StateKind::kExpAvgSq: return "exp_avg_sq";
    case StateKind::kParamBf16: return "param_bf16";
  }
  return "?";
}

}  // namespace shardopt
