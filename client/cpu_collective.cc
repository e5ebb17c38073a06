#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "kernels/adamw_math.h"
#include "shardopt/collective.h"

namespace shardopt {
namespace {

// What the ranks of one CpuCollective group share: each operation publishes
// every rank's buffer, meets at a barrier, lets each rank work on the
// others' buffers, and meets again before any buffer may change.
struct CpuGroup {
  CpuGroup(uint32_t n, std::chrono::milliseconds timeout) : size(n), barrier_timeout(timeout), buffers(n) {}
  const uint32_t size;
  // A rank that never arrives (its thread died or hangs) fails the others
  // after this long, and the group stays failed: its count of arrivals no
  // longer means anything.
  const std::chrono::milliseconds barrier_timeout;
  std::mutex mu;
  std::condition_variable cv;
  uint64_t generation = 0;
  uint32_t arrived = 0;
  bool broken = false;
  std::vector<void*> buffers;

  absl::Status Barrier() {
    std::unique_lock<std::mutex> lock(mu);
    const uint64_t gen = generation;
    if (!broken && ++arrived == size) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return absl::OkStatus();
    }
    if (!broken && !cv.wait_for(lock, barrier_timeout, [&] { return broken || generation != gen; })) {
      broken = true;
      cv.notify_all();
    }
    if (generation != gen) return absl::OkStatus();
    return absl::DeadlineExceededError(absl::StrCat("a local rank did not reach the node group's collective within ",
                                                    barrier_timeout.count(), " ms"));
  }
};

class CpuCollective final : public Collective {
 public:
  CpuCollective(std::shared_ptr<CpuGroup> group, uint32_t rank) : group_(std::move(group)), rank_(rank) {}
  uint32_t rank() const override { return rank_; }
  uint32_t size() const override { return group_->size; }

  absl::Status ReduceScatter(const uint16_t* in, float* out, absl::Span<const FlatRange> ranges) override {
    SHARDOPT_RETURN_IF_ERROR(CheckRanges(ranges));
    SHARDOPT_RETURN_IF_ERROR(Publish(const_cast<uint16_t*>(in)));
    const FlatRange mine = ranges[rank_];
    for (uint64_t i = mine.begin; i < mine.end; ++i) {
      float sum = math::bf16_to_float(Buffer<uint16_t>(0)[i]);
      for (uint32_t r = 1; r < size(); ++r) sum += math::bf16_to_float(Buffer<uint16_t>(r)[i]);
      out[i - mine.begin] = sum;
    }
    return group_->Barrier();
  }

  absl::Status AllGather(uint16_t* data, absl::Span<const FlatRange> ranges) override {
    SHARDOPT_RETURN_IF_ERROR(CheckRanges(ranges));
    SHARDOPT_RETURN_IF_ERROR(Publish(data));
    for (uint32_t r = 0; r < size(); ++r) {
      if (r == rank_ || ranges[r].size() == 0) continue;
      std::memcpy(data + ranges[r].begin, Buffer<uint16_t>(r) + ranges[r].begin, ranges[r].size() * 2);
    }
    return group_->Barrier();
  }

  absl::Status AllReduceSum(double* data, uint64_t count) override {
    SHARDOPT_RETURN_IF_ERROR(Publish(data));
    std::vector<double> sum(count, 0.0);
    for (uint32_t r = 0; r < size(); ++r) {
      for (uint64_t i = 0; i < count; ++i) sum[i] += Buffer<double>(r)[i];
    }
    // Everyone has read every buffer before any changes.
    SHARDOPT_RETURN_IF_ERROR(group_->Barrier());
    std::memcpy(data, sum.data(), count * sizeof(double));
    return absl::OkStatus();
  }

  absl::Status FromHost(const void* host_src, void* dst, uint64_t bytes) override {
    std::memcpy(dst, host_src, bytes);
    return absl::OkStatus();
  }

 private:
  absl::Status CheckRanges(absl::Span<const FlatRange> ranges) const {
    if (ranges.size() != size()) return absl::InvalidArgumentError("one range per rank is needed");
    return absl::OkStatus();
  }
  absl::Status Publish(void* buffer) {
    group_->buffers[rank_] = buffer;
    return group_->Barrier();
  }
  template <typename T>
  const T* Buffer(uint32_t r) const {
    return static_cast<const T*>(group_->buffers[r]);
  }

  std::shared_ptr<CpuGroup> group_;
  uint32_t rank_;
};

}  // namespace

std::vector<std::unique_ptr<Collective>> MakeCpuCollectives(uint32_t size, std::chrono::milliseconds barrier_timeout) {
  auto group = std::make_shared<CpuGroup>(size, barrier_timeout);
  std::vector<std::unique_ptr<Collective>> out;
  for (uint32_t r = 0; r < size; ++r) out.push_back(std::make_unique<CpuCollective>(group, r));
  return out;
}

}  // namespace shardopt
