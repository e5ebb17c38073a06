#include "bench/common.h"

#include <algorithm>
#include <chrono>
#include <ctime>
#include <limits>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace shardopt::bench {

bool AbslParseFlag(absl::string_view text, Count* count, std::string* error) {
  uint64_t value = 0;
  if (absl::ConsumePrefix(&text, "2^")) {
    if (absl::SimpleAtoi(text, &value) && value < 64) {
      count->value = uint64_t{1} << value;
      return true;
    }
  } else {
    int shift = 0;
    if (!text.empty()) {
      const char suffix = text.back();
      shift = suffix == 'K' ? 10 : suffix == 'M' ? 20 : suffix == 'G' ? 30 : 0;
      if (shift > 0) text.remove_suffix(1);
    }
    if (absl::SimpleAtoi(text, &value) && value <= (std::numeric_limits<uint64_t>::max() >> shift)) {
      count->value = value << shift;
      return true;
    }
  }
  *error = "not a count (say 1000, 64M or 2^26)";
  return false;
}

std::string AbslUnparseFlag(Count count) { return absl::StrCat(count.value); }

void FillGradients(uint16_t* out, uint64_t n) {
  uint64_t x = 0x9E3779B97F4A7C15ull;
  for (uint64_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    const uint32_t exponent = 117 + static_cast<uint32_t>(x % 10);  // 2^-10 .. 2^-1
    out[i] = static_cast<uint16_t>((exponent << 7) | ((x >> 32) & 0x7F));
  }
}

namespace {
double ProcessCpuSeconds() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}
}  // namespace

absl::StatusOr<std::vector<double>> BestOfInterleaved(uint64_t reps,
                                                      const std::vector<std::function<absl::Status()>>& runs,
                                                      std::vector<double>* cpu_seconds) {
  if (reps == 0) return absl::InvalidArgumentError("at least one timed repetition is needed");
  std::vector<double> best(runs.size(), std::numeric_limits<double>::infinity());
  std::vector<double> cpu(runs.size(), 0);
  for (uint64_t rep = 0; rep <= reps; ++rep) {
    for (size_t i = 0; i < runs.size(); ++i) {
      const double cpu_start = ProcessCpuSeconds();
      const auto start = std::chrono::steady_clock::now();
      if (auto st = runs[i](); !st.ok()) return st;
      const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
      if (rep > 0 && took.count() < best[i]) {
        best[i] = took.count();
        cpu[i] = ProcessCpuSeconds() - cpu_start;
      }
    }
  }
  if (cpu_seconds != nullptr) *cpu_seconds = std::move(cpu);
  return best;
}

}  // namespace shardopt::bench
