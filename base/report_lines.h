// A protobuf MessageDifferencer's report, as a status message shows it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace shardopt {

// The report's lines (one a field: "modified: world_size: 2 -> 3"), the
// first `shown` of them joined with "; ", and how many more there were: a
// status message is one line, and a job of many tensors renamed has a line
// for each.
inline std::string OneLineReport(absl::string_view report, size_t shown = 5) {
  std::vector<absl::string_view> lines = absl::StrSplit(report, '\n', absl::SkipEmpty());
  std::string out = absl::StrJoin(lines.begin(), lines.begin() + std::min(shown, lines.size()), "; ");
  if (lines.size() > shown) absl::StrAppend(&out, "; and ", lines.size() - shown, " more differences");
  return out;
}

}  // namespace shardopt
