// The server's refusal of a commit whose step's push it does not hold whole
// (FAILED_PRECONDITION), and how a client knows it. A client that pushed
// the step whole meets it when that server restarted since the push and
// restored the step before, which holds no push (docs/design.md, section
// 4.3): it pushes the step again, as the other servers answer that push as
// a retry.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace shardopt {

// The refusal's message begins with this; the server adds what is missing.
inline std::string PushIncomplete(uint64_t step) {
  return absl::StrCat("cannot commit step ", step, ": its push is incomplete");
}

// Anywhere in the message: the client puts the server's address first.
inline bool IsPushIncomplete(const absl::Status& st, uint64_t step) {
  return absl::IsFailedPrecondition(st) && absl::StrContains(st.message(), PushIncomplete(step));
}

}  // namespace shardopt
