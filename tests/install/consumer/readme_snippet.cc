// README.md's "Using the client" block, compiled as a user would paste it
// into a function of theirs: install_test.sh extracts it (its #include
// lines aside, which are here) into the file README_SNIPPET names.
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "shardopt/client.h"

// The README's stand-in for the caller's own handling of a status.
#define CHECK_OK(expr)                   \
  if (absl::Status s = (expr); !s.ok()) { \
    return s;                            \
  }

absl::Status ReadmeSnippet(uint32_t rank, uint32_t world_size) {
#include README_SNIPPET
  (void)result;
  return absl::OkStatus();
}
