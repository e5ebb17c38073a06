#include "server/device.h"

#include <iostream>

#include "absl/strings/numbers.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/gpu.h"

namespace shardopt {

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
        std::cerr << "shardopt-server: --device=auto chose cuda:0 (" << gpus << " usable GPUs)\n";
        return cuda;
      }
      if (auto_requires_gpu) {
        return absl::FailedPreconditionError(absl::StrCat("--device=auto with --auto_requires_gpu: cuda:0 failed (",
                                                          cuda.status().message(), "); pass --device=cpu to run on the CPU"));
      }
      std::cerr << "shardopt-server: --device=auto: cuda:0 failed (" << cuda.status().message() << "), using the CPU\n";
    } else if (auto_requires_gpu) {
      return absl::FailedPreconditionError(absl::StrCat("--device=auto with --auto_requires_gpu found no usable GPU (",
                                                        GpuUnavailableReason(), "); pass --device=cpu to run on the CPU"));
    } else {
      std::cerr << "shardopt-server: --device=auto chose the CPU: " << GpuUnavailableReason() << "\n";
    }
    return MakeCpuBackend(cpu);
  }
  if (device == "cuda" || absl::StartsWith(device, "cuda:")) {
    int index = 0;
    if (device != "cuda" && !absl::SimpleAtoi(device.substr(5), &index)) {
      return absl::InvalidArgumentError(absl::StrCat("bad --device '", device, "'"));
    }
    return MakeCudaBackend(index);
  }
  return absl::InvalidArgumentError(absl::StrCat("--device must be auto, cpu, cuda or cuda:N; got '", device, "'"));
}

}  // namespace shardopt
