// shardopt-cuda-kernel-bench: BenchCudaKernel as one JSON object on stdout,
// for device_check.sh. Exits 1, with the error in the JSON, when it cannot run.
#include <cstdio>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "kernels/gpu.h"

namespace {

std::string JsonString(absl::string_view s) {
  std::string out = "\"";
  for (const char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      out += absl::StrFormat("\\u%04x", c);
    } else {
      out += c;
    }
  }
  return out + "\"";
}

template <typename T>
bool ParseFlag(absl::string_view arg, absl::string_view name, T* value) {
  return absl::ConsumePrefix(&arg, name) && absl::SimpleAtoi(arg, value);
}

}  // namespace

int main(int argc, char** argv) {
  uint64_t elements = uint64_t{1} << 28;
  int device = 0;
  int iterations = 20;
  for (int i = 1; i < argc; ++i) {
    const absl::string_view arg = argv[i];
    if (!ParseFlag(arg, "--elements=", &elements) && !ParseFlag(arg, "--device=", &device) &&
        !ParseFlag(arg, "--iterations=", &iterations)) {
      std::fprintf(stderr, "usage: %s [--elements=N] [--device=N] [--iterations=N]\n", argv[0]);
      return 2;
    }
  }
  const auto result = shardopt::BenchCudaKernel(elements, device, iterations);
  if (!result.ok()) {
    std::printf("{\"error\": %s, \"code\": %s, \"elements\": %llu}\n",
                JsonString(result.status().message()).c_str(),
                JsonString(absl::StatusCodeToString(result.status().code())).c_str(),
                static_cast<unsigned long long>(elements));
    return 1;
  }
  std::string describe = "cuda";
  if (auto backend = shardopt::MakeCudaBackend(device); backend.ok()) describe = (*backend)->Describe();
  std::printf(
      "{\"device\": %s, \"elements\": %llu, \"iterations\": %d, \"elements_per_second\": %.6g, "
      "\"bytes_per_element\": %.0f, \"copy_bytes_per_second\": %.6g, \"fraction_of_roofline\": %.4f}\n",
      JsonString(describe).c_str(), static_cast<unsigned long long>(elements), iterations,
      result->elements_per_second, result->bytes_per_element, result->copy_bytes_per_second,
      result->elements_per_second * result->bytes_per_element / result->copy_bytes_per_second);
  return 0;
}
