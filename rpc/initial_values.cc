#include "rpc/initial_values.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/adamw_math.h"

namespace shardopt {

absl::Status CheckInitialValues(const char* data, uint64_t count, bool fp32, bool bf16_state, InitialKind kind,
                                absl::string_view quoted_tensor, uint64_t first) {
  const char* name = kind == InitialKind::kMaster ? "master" : kind == InitialKind::kExpAvg ? "exp_avg" : "exp_avg_sq";
  for (uint64_t i = 0; i < count; ++i) {
    float x, given;
    if (fp32) {
      std::memcpy(&given, data + 4 * i, 4);
      x = bf16_state ? math::bf16_to_float(math::float_to_bf16(given)) : given;
    } else {
      uint16_t h;
      std::memcpy(&h, data + 2 * i, 2);
      x = given = math::bf16_to_float(h);
    }
    // +Inf is a v that training reaches from finite gradients (one whose
    // (1 - beta2) g g passes fp32's range, past about 6e20 at beta2 0.999;
    // torch's v does the same), so a state dict saved after it must load
    // back; the element's update is then its weight decay alone. A NaN or
    // -Inf v no run reaches.
    if (kind == InitialKind::kExpAvgSq && x == std::numeric_limits<float>::infinity()) continue;
    if (!std::isfinite(x)) {
      // A finite fp32 value past bf16's largest rounds to infinity in a
      // group that keeps bf16 state.
      return absl::InvalidArgumentError(absl::StrCat(
          "initial ", name, " of tensor ", quoted_tensor, " element ", first + i,
          std::isfinite(given) ? absl::StrCat(" (", given, ") rounds to infinity in its group's bf16 state")
                               : std::string(" is not finite")));
    }
    // As given, not as rounded into a bf16 group: -1e-45 rounds to -0,
    // which would be taken there and refused in an fp32 group. (-0 itself
    // is taken: it is zero.)
    if (kind == InitialKind::kExpAvgSq && given < 0) {
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
