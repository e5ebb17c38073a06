// The check of initial values (Init's master, exp_avg and exp_avg_sq) that
// both edges make alike: the server of each chunk it is sent, and the client
// of a whole call before it sends any chunk, so that a call the server would
// refuse partway leaves nothing written.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace shardopt {

enum class InitialKind { kMaster, kExpAvg, kExpAvgSq };

// OK if each of the `count` elements at `data` (fp32 floats if `fp32`, else
// bf16 bits) is a value the state takes as `kind`: finite as its group holds
// it (`bf16_state`: an fp32 value is rounded to bf16 first, and may overflow
// to Inf), and an exp_avg_sq not negative (its square root is taken); an
// exp_avg_sq may be +Inf, as a run's own v becomes past g of about 6e20
// (and one that rounds to +Inf in bf16 state, as a bf16 v does). Else
// INVALID_ARGUMENT naming the first that is not, as element `first` + i of
// the tensor `quoted_tensor` (its name as the caller quotes it).
absl::Status CheckInitialValues(const char* data, uint64_t count, bool fp32, bool bf16_state, InitialKind kind,
                                absl::string_view quoted_tensor, uint64_t first);

// The largest Adam step count Init takes: a double's exact integers (the
// Python client keeps counts as floats), far from the wrap at 2^64 that
// would make the next update's bias correction 1 - beta1^0 = 0 (NaN state).
inline constexpr uint64_t kMaxAdamStep = uint64_t{1} << 53;

// OK if `adam_step` is one Init takes (0: the count is left as it is); else
// INVALID_ARGUMENT.
absl::Status CheckAdamStep(uint64_t adam_step, absl::string_view quoted_tensor);

}  // namespace shardopt
