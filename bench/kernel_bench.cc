// `shardopt-bench kernel`: the fused AdamW against its roofline, both run in
// the same process on the same buffers, threads and work split
// (docs/design.md, section 10.1).
#include <algorithm>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/benches.h"
#include "bench/common.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/gpu.h"
#include "kernels/step_scalars.h"

namespace shardopt::bench {

namespace {

// Per element: a bf16 gradient and fp32 p, m, v in; p, m, v and a bf16 param out.
constexpr uint64_t kCpuBytesPerElement = 2 + 12 + 12 + 2;

// On a GPU the roofline is device-to-device copy bandwidth (docs/design.md,
// section 10.1); kernels/cuda times both with CUDA events.
absl::StatusOr<nlohmann::json> CudaKernelBench(int device, uint64_t elements, uint64_t iterations) {
  auto r = BenchCudaKernel(elements, device, static_cast<int>(iterations));
  if (!r.ok()) return r.status();
  return nlohmann::json{
      {"benchmark", "kernel"},
      {"device", absl::StrCat("cuda:", device)},
      {"elements", elements},
      {"iterations", iterations},
      {"update_seconds", static_cast<double>(elements) / r->elements_per_second},
      {"bytes_per_element", r->bytes_per_element},
      {"elements_per_second", r->elements_per_second},
      {"bytes_per_second", r->elements_per_second * r->bytes_per_element},
      {"copy_bytes_per_second", r->copy_bytes_per_second},
      {"fraction_of_roofline", r->elements_per_second * r->bytes_per_element / r->copy_bytes_per_second},
  };
}

absl::StatusOr<nlohmann::json> CpuKernelBench(uint64_t threads, uint64_t elements, uint64_t iterations) {
  CpuBackendOptions options;
  options.threads = static_cast<int>(threads > 0 ? threads : std::max(1u, std::thread::hardware_concurrency()));
  auto backend = MakeCpuBackend(options);
  JobLayout layout;
  layout.shards = {{elements, Precision::kFp32}};
  auto state = backend->Allocate(layout);
  if (!state.ok()) return state.status();
  JobState& job = **state;

  // In pieces, so the payload costs no second copy of the gradient in memory.
  std::vector<uint16_t> grads(std::min<uint64_t>(elements, uint64_t{1} << 20));
  for (uint64_t off = 0; off < elements; off += grads.size()) {
    const uint64_t n = std::min<uint64_t>(grads.size(), elements - off);
    FillGradients(grads.data(), n);
    if (auto st = job.WriteGrad(0, 0, off, DType::kBf16, grads.data(), n); !st.ok()) return st;
  }

  ShardStep step;
  step.grads.ranks = {0};
  step.scalars = ComputeAdamWScalars(AdamWHyper{}, 1e-3, 1.0f, 1);
  auto best = BestOfInterleaved(iterations, {
                                                [&] { return job.Apply({&step, 1}); },
                                                [&] { return RunCpuStreamRoofline(job, {&step, 1}); },
                                            });
  if (!best.ok()) return best.status();
  const double update_seconds = (*best)[0];
  const double stream_seconds = (*best)[1];
  const double n = static_cast<double>(elements);
  return nlohmann::json{
      {"benchmark", "kernel"},
      {"device", "cpu"},
      {"isa", cpu::IsaName(options.isa)},
      {"threads", options.threads},
      {"elements", elements},
      {"iterations", iterations},
      {"bytes_per_element", kCpuBytesPerElement},
      {"update_seconds", update_seconds},
      {"stream_seconds", stream_seconds},
      {"elements_per_second", n / update_seconds},
      {"bytes_per_second", n * kCpuBytesPerElement / update_seconds},
      {"stream_bytes_per_second", n * kCpuBytesPerElement / stream_seconds},
      {"fraction_of_roofline", stream_seconds / update_seconds},
  };
}

}  // namespace

absl::StatusOr<nlohmann::json> KernelBench(const KernelArgs& args) {
  if (args.cuda_device >= 0) return CudaKernelBench(args.cuda_device, args.elements, args.iterations);
  return CpuKernelBench(args.threads, args.elements, args.iterations);
}

}  // namespace shardopt::bench
