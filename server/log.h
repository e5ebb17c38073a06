// The server's log: one line per event on stderr, with a UTC timestamp, a
// level, the event's name and key=value fields, or one JSON object per line
// (--log_format=json). Written through spdlog (Debian's), which this header
// keeps out of every includer.
//
// What is logged is listed in docs/design.md (operations). Never tokens,
// never tensor data: fields are names, numbers and status messages.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/string_view.h"

namespace shardopt::log {

enum class Format { kText, kJson };
enum class Level { kInfo, kWarning, kError };

// One field; numbers are formatted by the caller (absl::StrCat).
using Fields = std::vector<std::pair<std::string, std::string>>;

// Chooses the format; before it, lines are text. Call once, first.
void Init(Format format);

void Write(Level level, absl::string_view event, const Fields& fields);
inline void Info(absl::string_view event, const Fields& fields = {}) { Write(Level::kInfo, event, fields); }
inline void Warning(absl::string_view event, const Fields& fields = {}) { Write(Level::kWarning, event, fields); }
inline void Error(absl::string_view event, const Fields& fields = {}) { Write(Level::kError, event, fields); }

// For events a client can cause at will (refusals): true for at most
// `per_second` calls per key each second. The first line let through after
// some were held back carries how many, as suppressed=N in `fields`.
bool Allow(const std::string& key, Fields* fields, int per_second = 5);
// Logs, as one `suppressed` line per key (key=..., suppressed=N), the lines
// Allow held back that no later line has counted yet: at the end of a run,
// so that none goes uncounted.
void ReportSuppressed();

}  // namespace shardopt::log
