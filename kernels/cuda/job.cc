#include "kernels/cuda/job.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/cuda/kernels.h"

namespace shardopt::cuda {

absl::StatusOr<std::unique_ptr<CudaJobState>> CudaJobState::Create(std::shared_ptr<Device> device,
                                                                   const JobLayout& layout) {
  // A launch's table and its partials each travel through one staging slot.
  SHARDOPT_ASSIGN_OR_RETURN(auto plan, ArenaPlan::Create(layout, Device::kSlotBytes));
  std::unique_ptr<CudaJobState> job(new CudaJobState(std::move(device), std::move(plan)));
  SHARDOPT_RETURN_IF_ERROR(job->Init());  // whatever Init got is freed with `job`
  return job;
}

absl::Status CudaJobState::Init() {
  const uint64_t arena_bytes = plan_.bytes();
  SHARDOPT_RETURN_IF_ERROR(device_->Enter());
  size_t free = 0, total = 0;
  SHARDOPT_RETURN_IF_ERROR(device_->Check(cudaMemGetInfo(&free, &total), "cudaMemGetInfo"));
  if (arena_bytes > free) {
    return absl::ResourceExhaustedError(absl::StrCat("the job needs ", arena_bytes, " bytes of device memory; ",
                                                     device_->description(), " has ", free, " free"));
  }
  SHARDOPT_RETURN_IF_ERROR(device_->Check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate"));
  if (arena_bytes == 0) return absl::OkStatus();
  SHARDOPT_RETURN_IF_ERROR(device_->Check(cudaMalloc(&arena_, arena_bytes), "cudaMalloc"));
  SHARDOPT_RETURN_IF_ERROR(device_->Check(cudaMemsetAsync(arena_, 0, arena_bytes, stream_), "cudaMemsetAsync"));
  return Sync();
}

CudaJobState::~CudaJobState() {
  if (stream_ == nullptr) return;
  // Queued copies and launches still use the arena and the staging slots.
  device_->Check(cudaSetDevice(device_->index()), "cudaSetDevice").IgnoreError();
  device_->Check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize").IgnoreError();
  if (arena_ != nullptr) device_->Check(cudaFree(arena_), "cudaFree").IgnoreError();
  device_->Check(cudaStreamDestroy(stream_), "cudaStreamDestroy").IgnoreError();
}

absl::Status CudaJobState::Sync() const {
  return device_->Check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
}

absl::Status CudaJobState::WriteGrad(uint32_t shard, uint32_t rank, uint64_t offset, DType dtype,
                                     const void* data, uint64_t count) {
  std::lock_guard<std::mutex> lock(mu_);
  SHARDOPT_RETURN_IF_ERROR(device_->Enter());
  SHARDOPT_RETURN_IF_ERROR(CheckGradWrite(plan_.layout(), shard, rank, offset, dtype, count));
  const ShardPlacement& s = plan_.shard(shard);
  const uint64_t esize = DTypeSize(plan_.layout().grad_dtype);
  const DeviceArray dst{At(s.grads + rank * s.slot_stride + offset * esize), esize};
  const char* src = static_cast<const char*>(data);
  const bool widen = dtype != plan_.layout().grad_dtype;  // bf16 into fp32 slots, on the host
  return device_->Upload(stream_, {&dst, 1}, count, [&](uint64_t first, uint64_t n, char* const* staged) {
    if (!widen) {
      std::memcpy(staged[0], src + first * esize, n * esize);
      return;
    }
    WidenBf16(reinterpret_cast<const uint16_t*>(src) + first, n, reinterpret_cast<float*>(staged[0]));
  });
}

// The sum is read back, added to on the host with the CPU's loop, and
// written again: 8 B/element of PCIe traffic instead of a kernel of its own,
// so that the one fold the bits depend on is the host's, tested here.
absl::Status CudaJobState::AccumulateGrad(uint32_t shard, uint64_t offset, DType dtype,
                                          absl::Span<const absl::string_view> runs, bool first) {
  std::lock_guard<std::mutex> lock(mu_);
  SHARDOPT_RETURN_IF_ERROR(device_->Enter());
  const uint64_t count = RunElements(runs, dtype);
  SHARDOPT_RETURN_IF_ERROR(CheckAccumulate(plan_.layout(), shard, offset, count));
  const ShardPlacement& s = plan_.shard(shard);
  const DeviceArray sum{At(s.grads + offset * 4), 4};
  std::vector<float> host(count);
  if (!first) {
    SHARDOPT_RETURN_IF_ERROR(device_->Download(stream_, sum, count, [&](uint64_t at, uint64_t n, const char* staged) {
      std::memcpy(host.data() + at, staged, n * 4);
    }));
  }
  // Every run folded on the host, then one upload for them all.
  uint64_t at = 0;
  for (absl::string_view run : runs) {
    const uint64_t n = run.size() / DTypeSize(dtype);
    AccumulateOnHost(host.data() + at, run.data(), dtype, n, first);
    at += n;
  }
  return device_->Upload(stream_, {&sum, 1}, count, [&](uint64_t at, uint64_t n, char* const* staged) {
    std::memcpy(staged[0], host.data() + at, n * 4);
  });
}

absl::Status CudaJobState::WriteState(uint32_t shard, StateKind kind, uint64_t offset, DType dtype,
                                      const void* data, uint64_t count) {
  std::lock_guard<std::mutex> lock(mu_);
  SHARDOPT_RETURN_IF_ERROR(device_->Enter());
  SHARDOPT_RETURN_IF_ERROR(CheckShardRange(plan_.layout(), shard, offset, count));
  if (kind == StateKind::kParamBf16) {
    return absl::InvalidArgumentError("bf16 params are derived from the master; write the master");
  }
  const ShardPlacement& s = plan_.shard(shard);
  const bool fp32_state = s.layout.precision == Precision::kFp32;
  const bool master = kind == StateKind::kMaster;
  // Converted on the host, by the same adamw_math.h functions the CPU uses.
  const DeviceArray dsts[2] = {{At(s.StateOffset(kind) + offset * s.state_elem_bytes), s.state_elem_bytes},
                               {At(s.param_out + offset * 2), 2}};
  return device_->Upload(stream_, {dsts, master ? 2u : 1u}, count,
                         [&](uint64_t first, uint64_t n, char* const* staged) {
                           for (uint64_t i = 0; i < n; ++i) {
                             // `data` need not be aligned: a restore's pieces start anywhere.
                             const float x = LoadAsFloat(static_cast<const char*>(data), first + i, dtype);
                             if (fp32_state) {
                               reinterpret_cast<float*>(staged[0])[i] = x;
                             } else {
                               reinterpret_cast<uint16_t*>(staged[0])[i] = math::float_to_bf16(x);
                             }
                             if (master) reinterpret_cast<uint16_t*>(staged[1])[i] = math::float_to_bf16(x);
                           }
                         });
}

absl::Status CudaJobState::ReadState(uint32_t shard, StateKind kind, uint64_t offset, uint64_t count,
                                     DType dtype, void* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  SHARDOPT_RETURN_IF_ERROR(device_->Enter());
  SHARDOPT_RETURN_IF_ERROR(CheckShardRange(plan_.layout(), shard, offset, count));
  const ShardPlacement& s = plan_.shard(shard);
  char* dst = static_cast<char*>(out);
  if (kind == StateKind::kParamBf16) {
    if (dtype != DType::kBf16) return absl::InvalidArgumentError("params are read as bf16");
    return device_->Download(stream_, {At(s.param_out + offset * 2), 2}, count,
                             [&](uint64_t first, uint64_t n, const char* staged) {
                               std::memcpy(dst + first * 2, staged, n * 2);
                             });
  }
  if (dtype != DType::kFp32) return absl::InvalidArgumentError("master, m and v are read as fp32");
  const bool fp32_state = s.layout.precision == Precision::kFp32;
  return device_->Download(stream_, {At(s.StateOffset(kind) + offset * s.state_elem_bytes), s.state_elem_bytes},
                           count, [&](uint64_t first, uint64_t n, const char* staged) {
                             if (fp32_state) {
                               std::memcpy(dst + first * 4, staged, n * 4);
                               return;
                             }
                             for (uint64_t i = 0; i < n; ++i) {
                               reinterpret_cast<float*>(dst)[first + i] =
                                   math::bf16_to_float(reinterpret_cast<const uint16_t*>(staged)[i]);
                             }
                           });
}

absl::Status CudaJobState::UploadTable(const TableImage& table) const {
  const DeviceArray dst{At(plan_.table()), 1};
  return device_->Upload(stream_, {&dst, 1}, table.size(), [&](uint64_t first, uint64_t n, char* const* staged) {
    std::memcpy(staged[0], table.data() + first, n);
  });
}

absl::StatusOr<GradStats> CudaJobState::ReduceGrads(absl::Span<const ShardGrads> shards) const {
  std::lock_guard<std::mutex> lock(mu_);
  SHARDOPT_RETURN_IF_ERROR(device_->Enter());
  PartialsSum sum;
  auto done = plan_.ForEachReduce(At(0), shards, [&](const TableImage& table, const Launch& launch) {
    SHARDOPT_RETURN_IF_ERROR(UploadTable(table));
    SHARDOPT_RETURN_IF_ERROR(device_->Check(LaunchReduce(launch, stream_), "the sum-of-squares launch"));
    // Waiting here, not inside Download, keeps the staging lock that other
    // jobs' transfers share free while the kernel runs.
    SHARDOPT_RETURN_IF_ERROR(Sync());
    return device_->Download(stream_, {At(plan_.partials()), sizeof(double)}, launch.unit_count,
                             [&](uint64_t, uint64_t n, const char* staged) {
                               sum.Add({reinterpret_cast<const double*>(staged), n});
                             });
  });
  if (!done.ok()) return done;
  return sum.stats();
}

absl::Status CudaJobState::EnqueueApply(absl::Span<const ShardStep> steps) {
  std::lock_guard<std::mutex> lock(mu_);
  SHARDOPT_RETURN_IF_ERROR(device_->Enter());
  return plan_.ForEachUpdate(At(0), steps, [&](const TableImage& table, const Launch& launch) {
    SHARDOPT_RETURN_IF_ERROR(UploadTable(table));
    return device_->Check(LaunchUpdate(launch, stream_), "the fused AdamW launch");
  });
}

absl::Status CudaJobState::Apply(absl::Span<const ShardStep> steps) {
  SHARDOPT_RETURN_IF_ERROR(EnqueueApply(steps));
  // Kernel faults surface here, and the gradient slots are free to rewrite.
  return Sync();
}

absl::Status CudaJobState::FillParamsOut(uint32_t shard, uint8_t byte) {
  std::lock_guard<std::mutex> lock(mu_);
  SHARDOPT_RETURN_IF_ERROR(device_->Enter());
  SHARDOPT_RETURN_IF_ERROR(CheckShardRange(plan_.layout(), shard, 0, 0));
  const ShardPlacement& s = plan_.shard(shard);
  SHARDOPT_RETURN_IF_ERROR(device_->Check(cudaMemsetAsync(At(s.param_out), byte, s.layout.numel * 2, stream_), "cudaMemsetAsync"));
  return Sync();
}

MemoryUse CudaJobState::memory_use() const {
  MemoryUse use;
  use.state_bytes = plan_.state_bytes();
  // Everything else in the arena: gradient slots, bf16 params, the launch
  // table, the reduction partials and alignment padding.
  use.staging_bytes = plan_.bytes() - plan_.state_bytes();
  return use;
}

Precision CudaJobState::held_precision(uint32_t shard) const {
  return plan_.shard(shard).state_elem_bytes == 4 ? Precision::kFp32 : Precision::kBf16;
}

}  // namespace shardopt::cuda
