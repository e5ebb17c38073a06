#include "server/memory_budget.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <optional>
#include <string>
#include <vector>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_split.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace shardopt {
namespace {

// A cgroup limit file's number; "max" and anything unreadable are none.
std::optional<uint64_t> ReadLimit(const char* path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text)) return std::nullopt;
  uint64_t v;
  if (!absl::SimpleAtoi(text, &v)) return std::nullopt;
  return v;
}

std::string Gib(uint64_t bytes) { return absl::StrCat(static_cast<double>(bytes) / (1 << 30), " GiB"); }

// The memory limits that apply to this process: its own cgroup's and every
// ancestor's, for v2 (memory.max) and v1 (memory.limit_in_bytes). Inside a
// container the cgroup namespace makes its own path "/".
std::vector<std::string> LimitFiles() {
  std::vector<std::string> files;
  std::ifstream in("/proc/self/cgroup");
  std::string line;
  while (std::getline(in, line)) {
    // "hierarchy-id:controllers:path"; v2's controllers are empty.
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    std::string base, file;
    if (controllers.empty()) {
      base = "/sys/fs/cgroup";
      file = "memory.max";
    } else if (absl::StrContains(absl::StrCat(",", controllers, ","), ",memory,")) {
      base = "/sys/fs/cgroup/memory";
      file = "memory.limit_in_bytes";
    } else {
      continue;
    }
    std::string path = line.substr(b + 1);
    for (;;) {
      files.push_back(absl::StrCat(base, path == "/" ? "" : path, "/", file));
      if (path.empty() || path == "/") break;
      path = path.substr(0, path.rfind('/'));
    }
  }
  return files;
}

// What this process may use: the smaller of physical memory and the limits
// of its cgroups, and which one that is.
uint64_t UsableMemory(std::string* source) {
  const uint64_t physical = uint64_t(sysconf(_SC_PHYS_PAGES)) * uint64_t(sysconf(_SC_PAGE_SIZE));
  uint64_t total = physical;
  *source = absl::StrCat("physical memory ", Gib(physical));
  // v1's "no limit" is a huge number, larger than the machine: min() skips it.
  for (const std::string& path : LimitFiles()) {
    if (auto v = ReadLimit(path.c_str()); v && *v < total) {
      total = *v;
      *source = absl::StrCat("cgroup limit ", Gib(*v), " (", path, ")");
    }
  }
  return total;
}

}  // namespace

uint64_t MemoryBudget::DefaultLimit(std::string* found) {
  std::string source;
  const uint64_t total = UsableMemory(&source);
  const uint64_t headroom = std::max<uint64_t>(uint64_t{256} << 20, total / 8);
  const uint64_t limit = total > headroom ? total - headroom : total / 2;
  if (found != nullptr) *found = absl::StrCat(source, " less ", Gib(total - limit), " headroom");
  return limit;
}

std::optional<uint64_t> MemoryBudget::ParseBytes(absl::string_view text) {
  static constexpr std::pair<const char*, uint64_t> kSuffixes[] = {
      {"Ki", uint64_t{1} << 10}, {"Mi", uint64_t{1} << 20}, {"Gi", uint64_t{1} << 30}, {"Ti", uint64_t{1} << 40},
      {"K", 1000}, {"M", 1000 * 1000}, {"G", 1000 * 1000 * 1000}, {"T", uint64_t{1000} * 1000 * 1000 * 1000}};
  uint64_t unit = 1;
  absl::string_view number = text;
  for (const auto& [suffix, scale] : kSuffixes) {
    if (absl::EndsWith(number, suffix)) {
      number.remove_suffix(std::char_traits<char>::length(suffix));
      unit = scale;
      break;
    }
  }
  uint64_t v;
  // Digits only: SimpleAtoi also takes "512 " and "+512".
  if (number.empty() || number.find_first_not_of("0123456789") != absl::string_view::npos ||
      !absl::SimpleAtoi(number, &v) || v == 0 || v > UINT64_MAX / unit) {
    return std::nullopt;
  }
  return v * unit;
}

absl::StatusOr<uint64_t> MemoryBudget::ParseLimit(absl::string_view text, std::string* found) {
  std::string from = "--memory_limit";
  uint64_t bytes;
  if (text == "auto") {
    bytes = DefaultLimit(&from);
  } else {
    const std::optional<uint64_t> given = ParseBytes(text);
    if (!given) {
      return absl::InvalidArgumentError(absl::StrCat("memory limit '", text,
                                                     "' is not 'auto' or a positive byte count such as 20Gi or 512M"));
    }
    // A budget the process cannot have refuses nothing: the kernel (or the
    // container's OOM killer) would stop the server first.
    std::string source;
    if (const uint64_t usable = UsableMemory(&source); *given > usable) {
      return absl::InvalidArgumentError(absl::StrCat("memory limit '", text, "' is more than this process may use, the ",
                                                     source, "; give less (it also needs headroom for what the budget "
                                                     "does not charge) or 'auto'"));
    }
    bytes = *given;
  }
  // Below it, the part kept for streams and checkpoints (at most half the
  // limit) is less than one checkpoint's buffers (kKeptAtLeast), so a full
  // budget could not checkpoint its jobs; a budget of a few bytes started
  // and refused every CreateJob.
  if (bytes < kLeastLimit) {
    return absl::InvalidArgumentError(absl::StrCat(
        "memory limit '", text, "' is ", bytes, " bytes (", from, "), under 64Mi (", kLeastLimit,
        " bytes): half of it, the most the budget keeps from jobs for their streams and checkpoints, would not hold "
        "one checkpoint's buffers (", kKeptAtLeast, " bytes)", text == "auto" ? "; give the server more memory" : ""));
  }
  if (found != nullptr) *found = from;
  return bytes;
}

absl::Status MemoryBudget::Take(uint64_t bytes, absl::string_view what, uint64_t keep_free) {
  const uint64_t cap = limit_ - std::min(keep_free, limit_);
  uint64_t used = used_.load(std::memory_order_relaxed);
  do {
    if (bytes > cap || used > cap - bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          what, " needs ", bytes, " bytes; this server's memory budget (--memory_limit=", limit_, ") has ",
          limit_ - std::min(used, limit_), " left",
          keep_free > 0 ? absl::StrCat(", of which a job may not take the last ", keep_free,
                                       ": they are kept for the streams and checkpoints of the jobs it holds")
                        : ""));
    }
  } while (!used_.compare_exchange_weak(used, used + bytes, std::memory_order_relaxed));
  return absl::OkStatus();
}

absl::StatusOr<MemoryBudget::Charge> MemoryBudget::Reserve(uint64_t bytes, absl::string_view what) {
  if (absl::Status st = Take(bytes, what); !st.ok()) return st;
  return Charge(this, bytes);
}

uint64_t MemoryBudget::kept_for_streams() const {
  return std::min({uint64_t{64} << 20, limit_ / 2, std::max(kKeptAtLeast, limit_ / 4)});
}

absl::StatusOr<MemoryBudget::Charge> MemoryBudget::ReserveForJob(uint64_t bytes, absl::string_view what) {
  if (absl::Status st = Take(bytes, what, kept_for_streams()); !st.ok()) return st;
  return Charge(this, bytes);
}

MemoryBudget::Charge& MemoryBudget::Charge::operator=(Charge&& other) noexcept {
  if (this != &other) {
    Release();
    budget_ = other.budget_;
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

absl::Status MemoryBudget::Charge::Grow(uint64_t more, absl::string_view what) {
  if (budget_ == nullptr || more == 0) return absl::OkStatus();
  if (absl::Status st = budget_->Take(more, what); !st.ok()) return st;
  bytes_ += more;
  return absl::OkStatus();
}

void MemoryBudget::Charge::Shrink(uint64_t less) {
  less = std::min(less, bytes_);
  if (budget_ != nullptr && less > 0) budget_->Give(less);
  bytes_ -= less;
}

}  // namespace shardopt
