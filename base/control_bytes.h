// Text that names what someone else chose (a job's name, a path), made safe
// for a terminal or a log line: its control bytes become \xHH, so that a
// name cannot write escape sequences, nor a line break that would read as
// another line.
#pragma once

#include <string>

#include "absl/strings/string_view.h"

namespace shardopt {

// `text` with each byte below 0x20, and 0x7f, as \xHH, and each of
// `backslashed` (a quoting context's own quote and backslash) behind a
// backslash.
std::string EscapeControlBytes(absl::string_view text, absl::string_view backslashed = {});

}  // namespace shardopt
