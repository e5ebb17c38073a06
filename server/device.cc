#include "server/device.h"


#include "absl/strings/numbers.h"
#include "absl/strings/match.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/gpu.h"
#include "server/log.h"

namespace shardopt {

absl::StatusOr<int> CudaDeviceIndex(const std::string& device) {
  if (device == "cuda") return 0;
  absl::string_view index = device;
  int n = -1;
  // Digits only: SimpleAtoi would also take "+1" and " 1".
  if (!absl::ConsumePrefix(&index, "cuda:") || index.empty() ||
      index.find_first_not_of("0123456789") != absl::string_view::npos || !absl::SimpleAtoi(index, &n)) {
    return absl::InvalidArgumentError(absl::StrCat("not cuda or cuda:N: '", device, "'"));
  }
  return n;
}

absl::StatusOr<std::unique_ptr<Backend>> MakeBackend(const std::string& device, int cpu_threads,
                                                     bool auto_requires_gpu) {
  CpuBackendOptions cpu;
  cpu.threads = cpu_threads;
  if (device == "cpu") return MakeCpuBackend(cpu);
  if (device == "auto") {
    const int gpus = UsableGpuCount();
    if (gpus > 0) {
      auto cuda = MakeCudaBackend(0);
      if (cuda.ok()) {
        log::Info("device_chosen", {{"device", "cuda:0"}, {"usable_gpus", absl::StrCat(gpus)}});
        return cuda;
      }
      if (auto_requires_gpu) {
        return absl::FailedPreconditionError(absl::StrCat("--device=auto with --auto_requires_gpu: cuda:0 failed (",
                                                          cuda.status().message(), "); pass --device=cpu to run on the CPU"));
      }
      log::Warning("device_chosen", {{"device", "cpu"}, {"why", absl::StrCat("cuda:0 failed: ", cuda.status().message())}});
    } else if (auto_requires_gpu) {
      return absl::FailedPreconditionError(absl::StrCat("--device=auto with --auto_requires_gpu found no usable GPU (",
                                                        GpuUnavailableReason(), "); pass --device=cpu to run on the CPU"));
    } else {
      log::Info("device_chosen", {{"device", "cpu"}, {"why", GpuUnavailableReason()}});
    }
    return MakeCpuBackend(cpu);
  }
  if (device == "cuda" || absl::StartsWith(device, "cuda:")) {
    absl::StatusOr<int> index = CudaDeviceIndex(device);
    if (!index.ok()) return absl::InvalidArgumentError(absl::StrCat("bad --device '", device, "'"));
    return MakeCudaBackend(*index);
  }
  return absl::InvalidArgumentError(absl::StrCat("--device must be auto, cpu, cuda or cuda:N; got '", device, "'"));
}

}  // namespace shardopt
