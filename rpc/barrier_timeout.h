// The server's answer to a push whose barrier's deadline passed before every
// rank had pushed (DEADLINE_EXCEEDED), and how a client tells it from gRPC's
// own deadline: each retry of such a push waits out the whole barrier again,
// which the client's error then says.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace shardopt {

// The answer's message begins with this; the server adds how long it
// waited and which ranks are missing.
inline std::string BarrierTimedOut(uint64_t step) { return absl::StrCat("barrier of step ", step, " timed out"); }

// Of any step (a client's retry loop does not know it), anywhere in the
// message: the client puts the server's address first.
inline bool IsBarrierTimeout(const absl::Status& st) {
  if (!absl::IsDeadlineExceeded(st)) return false;
  const absl::string_view message = st.message();
  const size_t at = message.find("barrier of step ");
  return at != absl::string_view::npos && message.find(" timed out", at) != absl::string_view::npos;
}

}  // namespace shardopt
