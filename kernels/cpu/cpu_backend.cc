#include "kernels/cpu/cpu_backend.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <sys/mman.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/cpu/aligned_buffer.h"
#include "kernels/cpu/param_regions.h"
#include "kernels/cpu/sum_tiles.h"
#include "kernels/cpu/thread_pool.h"

namespace shardopt {
namespace {

using cpu::AlignedBuffer;

// Work is cut into items of this many elements; an item is a whole number of
// tiles, so thread count changes who computes an item, never what it is.
constexpr uint64_t kItem = 16 * cpu::kTile;

// Whether a layout is a running sum's (one fp32 slot, AccumulatingLayout),
// whose slot the CPU keeps as SumTiles.
bool IsRunningSum(const JobLayout& layout) {
  return layout.world_size == 1 && layout.grad_dtype == DType::kFp32;
}

// What CpuJobState::Init allocates for one shard of `layout`: what the
// budget charges (HostBytes) and memory_use reports. The state and staging
// at their sizes, and as bookkeeping what their buffers are rounded up by
// and the running sum's per-tile flags and sums of squares. Per shard, not
// per job, which a job of many small tensors feels.
MemoryUse ShardBytes(const JobLayout& layout, const ShardLayout& s) {
  const uint64_t state = s.numel * (s.precision == Precision::kFp32 ? 4 : 2);
  const uint64_t grads = s.numel * layout.world_size * DTypeSize(layout.grad_dtype);
  MemoryUse use;
  use.state_bytes = 3 * state;
  use.staging_bytes = s.numel * 2 + grads;
  use.bookkeeping_bytes = 3 * AlignedBuffer::HostBytes(state) + cpu::ParamRegions::HostBytes(s.numel) +
                          AlignedBuffer::HostBytes(grads) - use.state_bytes - use.staging_bytes;
  if (IsRunningSum(layout)) use.bookkeeping_bytes += cpu::SumTiles::BookkeepingBytes(s.numel);
  return use;
}

struct CpuShard {
  ShardLayout layout;
  uint64_t state_elem_bytes = 0;  // 4 for FP32, 2 for BF16
  AlignedBuffer p, m, v;
  cpu::ParamRegions params;  // bf16 params as of the last update or write
  AlignedBuffer grads;       // world_size slots of numel gradient elements
  std::optional<cpu::SumTiles> sum;  // over `grads`, when the layout is a running sum's
};

class CpuJobState final : public JobState {
 public:
  CpuJobState(cpu::ThreadPool* pool, const cpu::LoopTable* loops, JobLayout layout)
      : pool_(pool), loops_(loops), layout_(std::move(layout)) {}

  absl::Status Init() {
    for (const ShardLayout& sl : layout_.shards) {
      CpuShard s;
      s.layout = sl;
      s.state_elem_bytes = sl.precision == Precision::kFp32 ? 4 : 2;
      const uint64_t state = sl.numel * s.state_elem_bytes;
      auto alloc = [](uint64_t bytes, AlignedBuffer* out) -> absl::Status {
        SHARDOPT_ASSIGN_OR_RETURN(auto b, AlignedBuffer::Zeroed(bytes));
        *out = std::move(b);
        return absl::OkStatus();
      };
      SHARDOPT_RETURN_IF_ERROR(alloc(state, &s.p));
      SHARDOPT_RETURN_IF_ERROR(alloc(state, &s.m));
      SHARDOPT_RETURN_IF_ERROR(alloc(state, &s.v));
      SHARDOPT_ASSIGN_OR_RETURN(s.params, cpu::ParamRegions::Make(sl.numel));
      SHARDOPT_RETURN_IF_ERROR(alloc(sl.numel * layout_.world_size * DTypeSize(layout_.grad_dtype), &s.grads));
      shards_.push_back(std::move(s));
      CpuShard& added = shards_.back();  // the slot's address is the mapping's, unmoved
      if (IsRunningSum(layout_)) added.sum.emplace(sl.numel, added.grads.data(), loops_);
    }
    return absl::OkStatus();
  }

  absl::Status WriteGrad(uint32_t shard, uint32_t rank, uint64_t offset, DType dtype,
                         const void* data, uint64_t count) override {
    SHARDOPT_RETURN_IF_ERROR(CheckGradWrite(layout_, shard, rank, offset, dtype, count));
    if (CpuShard& s = shards_[shard]; s.sum) s.sum->Forget(offset, count);  // fp32 values now, in place
    char* dst = GradSlot(shard, rank) + offset * DTypeSize(layout_.grad_dtype);
    if (dtype == layout_.grad_dtype) {
      std::memcpy(dst, data, count * DTypeSize(dtype));
      return absl::OkStatus();
    }
    WidenBf16(static_cast<const uint16_t*>(data), count, reinterpret_cast<float*>(dst));
    return absl::OkStatus();
  }

  absl::Status AccumulateGrad(uint32_t shard, uint64_t offset, DType dtype, absl::Span<const absl::string_view> runs,
                              bool first) override {
    SHARDOPT_RETURN_IF_ERROR(CheckAccumulate(layout_, shard, offset, RunElements(runs, dtype)));
    shards_[shard].sum->Fold(offset, dtype, runs, first);
    return absl::OkStatus();
  }

  void GradBlockDone(uint32_t shard, uint64_t offset, uint64_t count) override {
    if (CpuShard& s = shards_[shard]; s.sum) s.sum->Done(offset, count);
  }

  absl::Status WriteState(uint32_t shard, StateKind kind, uint64_t offset, DType dtype,
                          const void* data, uint64_t count) override {
    SHARDOPT_RETURN_IF_ERROR(CheckRange(shard, offset, count));
    if (kind == StateKind::kParamBf16) {
      return absl::InvalidArgumentError("bf16 params are derived from the master; write the master");
    }
    CpuShard& s = shards_[shard];
    char* dst = StateBuffer(s, kind).data() + offset * s.state_elem_bytes;
    if (kind == StateKind::kMaster) SHARDOPT_RETURN_IF_ERROR(s.params.PrepareWrite(offset, count));
    if (dtype == DType::kFp32 && s.layout.precision == Precision::kFp32) {
      // fp32 into fp32 (a restore's bulk): a copy, unless the data was read
      // into place, and the params from it.
      if (data != dst) std::memcpy(dst, data, count * 4);
      if (kind == StateKind::kMaster) {
        // From the copy, which is aligned: `data` need not be (a restore's
        // pieces start wherever the part's frame ends).
        const float* master = reinterpret_cast<const float*>(dst);
        s.params.ForEachRun(offset, count, [&](uint16_t* params, uint64_t first, uint64_t n) {
          const float* from = master + (first - offset);
          for (uint64_t i = 0; i < n; ++i) params[i] = math::float_to_bf16(from[i]);
        });
      }
      return absl::OkStatus();
    }
    for (uint64_t i = 0; i < count; ++i) {
      const float x = LoadAsFloat(static_cast<const char*>(data), i, dtype);  // `data` need not be aligned
      if (s.layout.precision == Precision::kFp32) {
        reinterpret_cast<float*>(dst)[i] = x;
      } else {
        reinterpret_cast<uint16_t*>(dst)[i] = math::float_to_bf16(x);
      }
    }
    if (kind == StateKind::kMaster) {
      s.params.ForEachRun(offset, count, [&](uint16_t* params, uint64_t first, uint64_t n) {
        for (uint64_t i = 0; i < n; ++i) {
          params[i] = math::float_to_bf16(LoadAsFloat(static_cast<const char*>(data), first - offset + i, dtype));
        }
      });
    }
    return absl::OkStatus();
  }

  absl::Status ReadState(uint32_t shard, StateKind kind, uint64_t offset, uint64_t count,
                         DType dtype, void* out) const override {
    SHARDOPT_RETURN_IF_ERROR(CheckRange(shard, offset, count));
    const CpuShard& s = shards_[shard];
    if (kind == StateKind::kParamBf16) {
      if (dtype != DType::kBf16) return absl::InvalidArgumentError("params are read as bf16");
      s.params.Read(offset, count, static_cast<uint16_t*>(out));
      return absl::OkStatus();
    }
    if (dtype != DType::kFp32) return absl::InvalidArgumentError("master, m and v are read as fp32");
    const char* src = StateBuffer(s, kind).data() + offset * s.state_elem_bytes;
    if (s.layout.precision == Precision::kFp32) {
      std::memcpy(out, src, count * 4);
    } else {
      for (uint64_t i = 0; i < count; ++i) {
        static_cast<float*>(out)[i] = math::bf16_to_float(reinterpret_cast<const uint16_t*>(src)[i]);
      }
    }
    return absl::OkStatus();
  }

  absl::StatusOr<Pieces> HoldState(uint32_t shard, StateKind kind, uint64_t offset, uint64_t count,
                                      DType dtype) const override {
    if (kind != StateKind::kParamBf16 || dtype != DType::kBf16) {
      return JobState::HoldState(shard, kind, offset, count, dtype);
    }
    SHARDOPT_RETURN_IF_ERROR(CheckRange(shard, offset, count));
    return shards_[shard].params.Hold(offset, count);
  }

  absl::StatusOr<GradStats> ReduceGrads(absl::Span<const ShardGrads> shards) const override {
    SHARDOPT_RETURN_IF_ERROR(CheckGrads(shards));
    // One partial per block, each computed whole by one thread, then summed
    // in block order: the result is independent of the thread count.
    std::vector<uint64_t> first_block(shards.size() + 1, 0);
    for (size_t i = 0; i < shards.size(); ++i) {
      const uint64_t n = shards_[shards[i].shard].layout.numel;
      first_block[i + 1] = first_block[i] + (n + cpu::kTile - 1) / cpu::kTile;
    }
    std::vector<double> partials(first_block.back());
    const uint64_t blocks_per_item = kItem / cpu::kTile;
    pool_->ParallelFor((partials.size() + blocks_per_item - 1) / blocks_per_item, [&](size_t item) {
      alignas(64) float tile[cpu::kTile];
      const uint64_t end = std::min<uint64_t>(partials.size(), (item + 1) * blocks_per_item);
      for (uint64_t b = item * blocks_per_item; b < end; ++b) {
        const size_t si = std::upper_bound(first_block.begin(), first_block.end(), b) - first_block.begin() - 1;
        const ShardGrads& sg = shards[si];
        const CpuShard& s = shards_[sg.shard];
        const uint64_t offset = (b - first_block[si]) * cpu::kTile;
        const uint64_t n = std::min(cpu::kTile, s.layout.numel - offset);
        if (s.sum) {  // one slot, read where it lies
          partials[b] = s.sum->Sumsq(offset / cpu::kTile);
          continue;
        }
        AggregateTile(sg, offset, n, tile);
        partials[b] = loops_->sumsq_block(tile, n);
      }
    });
    GradStats stats;
    for (double p : partials) stats.sum_squares += p;
    stats.nonfinite = !std::isfinite(stats.sum_squares);
    return stats;
  }

  absl::Status Apply(absl::Span<const ShardStep> steps) override {
    SHARDOPT_ASSIGN_OR_RETURN(auto ends, CheckSteps(steps));
    SHARDOPT_RETURN_IF_ERROR(PrepareParams(steps, ends));
    ForEachTile(steps, ends, [&](const ShardStep& step, uint64_t off, uint64_t len) { ApplyTile(step, off, len); });
    return absl::OkStatus();
  }

  absl::Status StreamRoofline(absl::Span<const ShardStep> steps) {
    SHARDOPT_ASSIGN_OR_RETURN(auto ends, CheckSteps(steps));
    if (layout_.grad_dtype != DType::kBf16) return absl::InvalidArgumentError("the roofline streams bf16 gradients");
    for (const ShardStep& st : steps) {
      if (shards_[st.grads.shard].layout.precision != Precision::kFp32 || st.grads.ranks.size() != 1) {
        return absl::InvalidArgumentError("the roofline streams FP32 shards with one rank's gradient");
      }
    }
    SHARDOPT_RETURN_IF_ERROR(PrepareParams(steps, ends));
    ForEachTile(steps, ends, [&](const ShardStep& step, uint64_t off, uint64_t len) {
      CpuShard& s = shards_[step.grads.shard];
      cpu::StreamArgs a;
      a.grad = reinterpret_cast<const uint16_t*>(GradSlot(step.grads.shard, step.grads.ranks[0])) + off;
      a.p = reinterpret_cast<float*>(s.p.data()) + off;
      a.m = reinterpret_cast<float*>(s.m.data()) + off;
      a.v = reinterpret_cast<float*>(s.v.data()) + off;
      a.param_out = s.params.At(off);
      a.n = len;
      loops_->stream(a);
    });
    return absl::OkStatus();
  }

  void Prefault(uint32_t shard, StateKind kind, uint64_t offset, uint64_t count) const override {
    if (shard >= shards_.size()) return;
    const CpuShard& s = shards_[shard];
    if (kind == StateKind::kParamBf16) {
      s.params.Prefault(offset, count);
      return;
    }
    const AlignedBuffer& buffer = StateBuffer(s, kind);
    if (!buffer.mapped() || offset >= s.layout.numel) return;  // a small buffer is touched already
    count = std::min(count, s.layout.numel - offset);
    // Whole pages inside the mapping, which starts on one. The kernel faults
    // them in writable without writing them (Linux 5.14 on; older kernels
    // refuse, and the write faults them as before).
    const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
    const uint64_t begin = offset * s.state_elem_bytes / page * page;
    const uint64_t end = std::min(buffer.bytes(), ((offset + count) * s.state_elem_bytes + page - 1) / page * page);
    madvise(buffer.data() + begin, end - begin, MADV_POPULATE_WRITE);
  }

  char* HostFp32State(uint32_t shard, StateKind kind) override {
    if (shard >= shards_.size() || kind == StateKind::kParamBf16) return nullptr;
    const CpuShard& s = shards_[shard];
    return s.state_elem_bytes == 4 ? StateBuffer(s, kind).data() : nullptr;
  }

  uint64_t HostStateRoom(uint32_t shard, StateKind kind) const override {
    if (shard >= shards_.size() || kind == StateKind::kParamBf16 || shards_[shard].state_elem_bytes != 4) return 0;
    const AlignedBuffer& buffer = StateBuffer(shards_[shard], kind);
    // A mapping's last page is whole; a small buffer ends where it ends.
    return buffer.mapped() ? AlignedBuffer::WholePages(buffer.bytes()) : buffer.bytes();
  }

  Precision held_precision(uint32_t shard) const override {
    return shards_[shard].state_elem_bytes == 4 ? Precision::kFp32 : Precision::kBf16;
  }

  MemoryUse memory_use() const override {
    MemoryUse use;
    for (const CpuShard& s : shards_) {
      const MemoryUse shard = ShardBytes(layout_, s.layout);
      use.state_bytes += shard.state_bytes;
      use.staging_bytes += shard.staging_bytes;
      use.bookkeeping_bytes += shard.bookkeeping_bytes;
    }
    return use;
  }

 private:
  absl::Status CheckRange(uint32_t shard, uint64_t offset, uint64_t count) const {
    return CheckShardRange(layout_, shard, offset, count);
  }

  absl::Status CheckGrads(absl::Span<const ShardGrads> shards) const {
    for (const ShardGrads& sg : shards) {
      SHARDOPT_RETURN_IF_ERROR(CheckShardGrads(layout_, sg));
    }
    return absl::OkStatus();
  }

  char* GradSlot(uint32_t shard, uint32_t rank) const {
    const CpuShard& s = shards_[shard];
    return s.grads.data() + uint64_t{rank} * s.layout.numel * DTypeSize(layout_.grad_dtype);
  }

  static const AlignedBuffer& StateBuffer(const CpuShard& s, StateKind kind) {
    return kind == StateKind::kMaster ? s.p : kind == StateKind::kExpAvg ? s.m : s.v;
  }

  // The fp32 sum of the contributing ranks' gradients, in rank order.
  void AggregateTile(const ShardGrads& sg, uint64_t offset, uint64_t n, float* tile) const {
    const uint64_t esize = DTypeSize(layout_.grad_dtype);
    for (size_t r = 0; r < sg.ranks.size(); ++r) {
      loops_->accumulate(tile, GradSlot(sg.shard, sg.ranks[r]) + offset * esize, layout_.grad_dtype, n, r == 0);
    }
  }

  // Makes the params the steps write writable (param_regions.h), before
  // the threads write them.
  absl::Status PrepareParams(absl::Span<const ShardStep> steps, const std::vector<uint64_t>& ends) {
    for (size_t i = 0; i < steps.size(); ++i) {
      SHARDOPT_RETURN_IF_ERROR(
          shards_[steps[i].grads.shard].params.PrepareWrite(steps[i].offset, ends[i] - steps[i].offset));
    }
    return absl::OkStatus();
  }

  // The end of each step's range, after checking it.
  absl::StatusOr<std::vector<uint64_t>> CheckSteps(absl::Span<const ShardStep> steps) const {
    std::vector<uint64_t> ends;
    for (const ShardStep& st : steps) {
      SHARDOPT_ASSIGN_OR_RETURN(auto end, CheckShardStep(layout_, st));
      ends.push_back(end);
    }
    return ends;
  }

  // Multi-tensor chunking: every shard's items go to the pool in one call.
  // The roofline shares this split, so it measures the update's own work
  // pattern.
  template <typename TileFn>
  void ForEachTile(absl::Span<const ShardStep> steps, const std::vector<uint64_t>& ends, const TileFn& tile_fn) {
    struct Item {
      const ShardStep* step;
      uint64_t offset;
      uint64_t n;
    };
    std::vector<Item> items;
    for (size_t i = 0; i < steps.size(); ++i) {
      for (uint64_t off = steps[i].offset; off < ends[i]; off += kItem) {
        items.push_back({&steps[i], off, std::min(kItem, ends[i] - off)});
      }
    }
    pool_->ParallelFor(items.size(), [&](size_t i) {
      const Item& item = items[i];
      for (uint64_t off = item.offset; off < item.offset + item.n; off += cpu::kTile) {
        tile_fn(*item.step, off, std::min(cpu::kTile, item.offset + item.n - off));
      }
    });
  }

  void ApplyTile(const ShardStep& step, uint64_t off, uint64_t len) {
    CpuShard& s = shards_[step.grads.shard];
    const uint64_t se = s.state_elem_bytes;
    alignas(64) float tile[cpu::kTile];
    cpu::UpdateArgs a;
    if (s.sum) {  // a running sum's tile, in whichever form it is
      a.grad = s.sum->Grad(off / cpu::kTile, &a.grad_dtype);
    } else if (step.grads.ranks.size() == 1) {  // no sum needed: read the slot itself
      a.grad = GradSlot(step.grads.shard, step.grads.ranks[0]) + off * DTypeSize(layout_.grad_dtype);
      a.grad_dtype = layout_.grad_dtype;
    } else {
      AggregateTile(step.grads, off, len, tile);
      a.grad = tile;
      a.grad_dtype = DType::kFp32;
    }
    a.p = s.p.data() + off * se;
    a.m = s.m.data() + off * se;
    a.v = s.v.data() + off * se;
    a.precision = s.layout.precision;
    a.param_out = s.params.At(off);
    a.n = len;
    a.scalars = step.scalars;
    loops_->update(a);
  }

  cpu::ThreadPool* pool_;
  const cpu::LoopTable* loops_;
  JobLayout layout_;
  std::vector<CpuShard> shards_;
};

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const CpuBackendOptions& o) : isa_(o.isa), pool_(o.threads), loops_(&cpu::Loops(o.isa)) {}

  std::string Describe() const override {
    return absl::StrCat("cpu (", cpu::IsaName(isa_), ", ", pool_.size(), " threads)");
  }

  uint64_t HostBytes(const JobLayout& layout) const override {
    uint64_t bytes = 0;
    for (const ShardLayout& s : layout.shards) {
      const MemoryUse shard = ShardBytes(layout, s);
      bytes += shard.state_bytes + shard.staging_bytes + shard.bookkeeping_bytes;
    }
    return bytes;
  }

  absl::StatusOr<std::unique_ptr<JobState>> Allocate(const JobLayout& layout) override {
    // Refused up front rather than left to overcommit: zeroing a job larger
    // than the machine would get the whole server killed.
    const uint64_t bytes = HostBytes(layout);
    const uint64_t physical = uint64_t(sysconf(_SC_PHYS_PAGES)) * uint64_t(sysconf(_SC_PAGE_SIZE));
    if (bytes > physical) {
      return absl::ResourceExhaustedError(absl::StrCat("the job needs ", bytes, " bytes of host memory; this machine has ",
                                                       physical));
    }
    auto state = std::make_unique<CpuJobState>(&pool_, loops_, layout);
    SHARDOPT_RETURN_IF_ERROR(state->Init());  // partial buffers are freed with `state`
    return state;
  }

 private:
  cpu::Isa isa_;
  cpu::ThreadPool pool_;
  const cpu::LoopTable* loops_;
};

}  // namespace

std::unique_ptr<Backend> MakeCpuBackend(const CpuBackendOptions& options) {
  return std::make_unique<CpuBackend>(options);
}

absl::Status RunCpuStreamRoofline(JobState& state, absl::Span<const ShardStep> steps) {
  auto* cpu_state = dynamic_cast<CpuJobState*>(&state);
  if (cpu_state == nullptr) return absl::InvalidArgumentError("the CPU roofline needs a job of the CPU backend");
  return cpu_state->StreamRoofline(steps);
}

}  // namespace shardopt
