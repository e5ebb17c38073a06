// The learning rates a commit carries, checked alike by the server and by
// the client. The client checks them before a Step pushes: a Step the
// server refused only at its commit had left its gradients sealed on the
// servers, and the caller's next Step, with fresh gradients, was answered
// as a retry of that push and applied the old ones.
#pragma once

#include <cmath>
#include <cstddef>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "base/shortest_number.h"
#include "kernels/step_scalars.h"

namespace shardopt {

// An lr the update can take: >= 0, and finite as the float it computes its
// step size in (an lr past 3.4e38 made every param inf, for good).
inline bool UsableLearningRate(double lr) { return lr >= 0 && std::isfinite(static_cast<float>(lr)); }

// OK if `lr` and each of `group_lr` is usable (UsableLearningRate),
// `group_lr` is empty or has one entry per group of the job (`groups`,
// named `job`), and each group's (`groups`, their lr multipliers as the
// job's spec has them, 0 made 1) update constants are finite as the floats
// the kernel takes (kernels/step_scalars.h): Decay, and StepSize at its
// largest, t = 1.
// Else INVALID_ARGUMENT naming the first that is not: an lr of 3e38 with a
// multiplier of 2, or a weight decay of 1e300, wrote -inf into the master,
// for good. Only the constants are checked: finite ones can still carry a
// huge master past the float range (a decay of -1e38), as torch's would.
inline absl::Status CheckLearningRates(double lr, absl::Span<const double> group_lr, absl::Span<const AdamWHyper> groups,
                                       absl::string_view job) {
  if (!UsableLearningRate(lr)) {
    return absl::InvalidArgumentError(absl::StrCat("lr must be finite and >= 0, and finite as a float, got ", ShortestNumber(lr)));
  }
  if (!group_lr.empty() && group_lr.size() != groups.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("group_lr has ", group_lr.size(), " entries; job '", job, "' has ", groups.size(), " groups"));
  }
  for (double g : group_lr) {
    if (!UsableLearningRate(g)) {
      return absl::InvalidArgumentError(absl::StrCat("every group_lr must be finite and >= 0, and finite as a float, got ",
                                                     ShortestNumber(g)));
    }
  }
  for (size_t g = 0; g < groups.size(); ++g) {
    const double lr_eff = EffectiveLr(groups[g], group_lr.empty() ? lr : group_lr[g]);
    const float decay = static_cast<float>(Decay(groups[g], lr_eff));
    const float step_size = static_cast<float>(StepSize(groups[g], lr_eff, 1));
    if (!std::isfinite(decay) || !std::isfinite(step_size)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "group ", g, "'s lr ", lr_eff, " (with its lr multiplier) makes the update's ",
          std::isfinite(decay) ? absl::StrCat("step size lr / (1 - beta1) ", step_size)
                               : absl::StrCat("decay 1 - lr * weight_decay (", groups[g].weight_decay, ") ", decay),
          " as a float"));
    }
  }
  return absl::OkStatus();
}

}  // namespace shardopt
