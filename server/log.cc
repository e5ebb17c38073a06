#include "server/log.h"

#include "base/control_bytes.h"

#include <algorithm>
#include <utility>
#include <vector>

#include <chrono>
#include <memory>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/control_bytes.h"
#include "nlohmann/json.hpp"
#include "spdlog/sinks/stdout_sinks.h"
#include "spdlog/spdlog.h"

namespace shardopt::log {
namespace {

struct State {
  absl::Mutex mu;
  Format format ABSL_GUARDED_BY(mu) = Format::kText;
  std::shared_ptr<spdlog::logger> logger ABSL_GUARDED_BY(mu);
  struct Bucket {
    std::chrono::steady_clock::time_point second;
    int used = 0;
    uint64_t held = 0;
  };
  absl::flat_hash_map<std::string, Bucket> buckets ABSL_GUARDED_BY(mu);
};

State& state() {
  static auto* s = new State;
  return *s;
}

std::shared_ptr<spdlog::logger> MakeLogger(Format format) {
  auto logger = std::make_shared<spdlog::logger>("shardopt", std::make_shared<spdlog::sinks::stderr_sink_mt>());
  // A UTC timestamp to the millisecond, then the level, then the line.
  logger->set_pattern(format == Format::kJson ? R"({"ts":"%Y-%m-%dT%H:%M:%S.%eZ","level":"%l",%v})"
                                              : "%Y-%m-%dT%H:%M:%S.%eZ %-7l %v",
                      spdlog::pattern_time_type::utc);
  logger->flush_on(spdlog::level::info);
  return logger;
}

// A text value: bare if it is one plain word, else quoted, with quotes and
// backslashes escaped and control bytes as \xHH: a name that a client chose
// (a job's) must not write escape sequences to an operator's terminal, nor
// a newline that would read as "x fake" where the name was "x\nfake".
std::string TextValue(const std::string& v) {
  bool plain = !v.empty();
  for (char c : v) plain = plain && c > ' ' && c != '"' && c != '=' && c != '\\' && c < 127;
  if (plain) return v;
  return absl::StrCat("\"", EscapeControlBytes(v, "\"\\"), "\"");
}

}  // namespace

void Init(Format format) {
  State& s = state();
  absl::MutexLock lock(&s.mu);
  s.format = format;
  s.logger = MakeLogger(format);
}

void Write(Level level, absl::string_view event, const Fields& fields) {
  State& s = state();
  std::shared_ptr<spdlog::logger> logger;
  Format format;
  {
    absl::MutexLock lock(&s.mu);
    if (!s.logger) s.logger = MakeLogger(s.format);
    logger = s.logger;
    format = s.format;
  }
  std::string line;
  if (format == Format::kJson) {
    line = absl::StrCat("\"event\":", nlohmann::json(std::string(event)).dump());
    for (const auto& [k, v] : fields) {
      absl::StrAppend(&line, ",", nlohmann::json(k).dump(), ":",
                      nlohmann::json(v).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    }
  } else {
    line = std::string(event);
    for (const auto& [k, v] : fields) absl::StrAppend(&line, " ", k, "=", TextValue(v));
  }
  const spdlog::level::level_enum l = level == Level::kInfo      ? spdlog::level::info
                                      : level == Level::kWarning ? spdlog::level::warn
                                                                 : spdlog::level::err;
  logger->log(l, "{}", line);
}

bool Allow(const std::string& key, Fields* fields, int per_second) {
  State& s = state();
  const auto now = std::chrono::steady_clock::now();
  absl::MutexLock lock(&s.mu);
  State::Bucket& b = s.buckets[key];
  if (now - b.second >= std::chrono::seconds(1)) {
    b.second = now;
    b.used = 0;
  }
  if (b.used >= per_second) {
    ++b.held;
    return false;
  }
  ++b.used;
  if (b.held > 0) {
    fields->emplace_back("suppressed", absl::StrCat(b.held));
    b.held = 0;
  }
  if (s.buckets.size() > 10000) s.buckets.clear();  // keys a client invents must not grow without end
  return true;
}

void ReportSuppressed() {
  State& s = state();
  std::vector<std::pair<std::string, uint64_t>> owed;
  {
    absl::MutexLock lock(&s.mu);
    for (auto& [key, b] : s.buckets) {
      if (b.held > 0) owed.emplace_back(key, b.held);
      b.held = 0;
    }
  }
  std::sort(owed.begin(), owed.end());
  for (const auto& [key, n] : owed) Warning("suppressed", {{"key", key}, {"suppressed", absl::StrCat(n)}});
}

}  // namespace shardopt::log
