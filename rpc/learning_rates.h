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

// OK if `lr` and each of `group_lr` is finite and >= 0, and `group_lr` is
// empty or has one entry per group of the job (`groups`, named `job`); else
// INVALID_ARGUMENT naming the first that is not.
inline absl::Status CheckLearningRates(double lr, absl::Span<const double> group_lr, size_t groups,
                                       absl::string_view job) {
  if (!std::isfinite(lr) || lr < 0) {
    return absl::InvalidArgumentError(absl::StrCat("lr must be finite and >= 0, got ", lr));
  }
  if (!group_lr.empty() && group_lr.size() != groups) {
    return absl::InvalidArgumentError(
        absl::StrCat("group_lr has ", group_lr.size(), " entries; job '", job, "' has ", groups, " groups"));
  }
  for (double g : group_lr) {
    if (!std::isfinite(g) || g < 0) {
      return absl::InvalidArgumentError(absl::StrCat("every group_lr must be finite and >= 0, got ", g));
    }
  }
  return absl::OkStatus();
}

}  // namespace shardopt
