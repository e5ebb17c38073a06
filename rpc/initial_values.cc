#include "rpc/initial_values.h"

#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kernels/adamw_math.h"

namespace shardopt {

absl::Status CheckInitialValues(const char* data, uint64_t count, bool fp32, bool bf16_state, InitialKind kind,
                                absl::string_view quoted_tensor, uint64_t first) {
  const char* name = kind == InitialKind::kMaster ? "master" : kind == InitialKind::kExpAvg ? "exp_avg" : "exp_avg_sq";
  for (uint64_t i = 0; i < count; ++i) {
    float x;
    if (fp32) {
      std::memcpy(&x, data + 4 * i, 4);
      if (bf16_state) x = math::bf16_to_float(math::float_to_bf16(x));
    } else {
      uint16_t h;
      std::memcpy(&h, data + 2 * i, 2);
      x = math::bf16_to_float(h);
    }
    if (!std::isfinite(x)) {
      return absl::InvalidArgumentError(
          absl::StrCat("initial ", name, " of tensor ", quoted_tensor, " element ", first + i, " is not finite"));
    }
    if (kind == InitialKind::kExpAvgSq && x < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("initial exp_avg_sq of tensor ", quoted_tensor, " element ", first + i, " is negative"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckAdamStep(uint64_t adam_step, absl::string_view quoted_tensor) {
  if (adam_step <= kMaxAdamStep) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("adam_step ", adam_step, " of tensor ", quoted_tensor,
                                                 " is over 2^53, the most Init takes"));
}

}  // namespace shardopt
