// The learning rates a commit carries, checked alike by the server and by
// the client. The client checks them before a Step pushes: a Step the
// server refused only at its commit had left its gradients sealed on the
// servers, and the caller's next Step, with fresh gradients, was answered
// as a retry of that push and applied the old ones.
#pragma once

#include <cmath>
#include <cstddef>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace shardopt {

// An lr the update can take: >= 0, and finite as the float it computes its
// step size in (an lr past 3.4e38 made every param inf, for good).
inline bool UsableLearningRate(double lr) { return lr >= 0 && std::isfinite(static_cast<float>(lr)); }

// OK if `lr` and each of `group_lr` is usable (UsableLearningRate), and
// `group_lr` is empty or has one entry per group of the job (`groups`,
// named `job`); else INVALID_ARGUMENT naming the first that is not.
inline absl::Status CheckLearningRates(double lr, absl::Span<const double> group_lr, size_t groups,
                                       absl::string_view job) {
  if (!UsableLearningRate(lr)) {
    return absl::InvalidArgumentError(absl::StrCat("lr must be finite and >= 0, and finite as a float, got ", lr));
  }
  if (!group_lr.empty() && group_lr.size() != groups) {
    return absl::InvalidArgumentError(
        absl::StrCat("group_lr has ", group_lr.size(), " entries; job '", job, "' has ", groups, " groups"));
  }
  for (double g : group_lr) {
    if (!UsableLearningRate(g)) {
      return absl::InvalidArgumentError(absl::StrCat("every group_lr must be finite and >= 0, and finite as a float, got ", g));
    }
  }
  return absl::OkStatus();
}

}  // namespace shardopt
