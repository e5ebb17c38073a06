// One budget for the host memory a server's jobs and streams hold: every
// allocation that grows with what clients ask for is charged before it is
// made, and refused with RESOURCE_EXHAUSTED (naming what was asked and what
// is left) when it does not fit, so the server is never the one the kernel's
// OOM killer picks. What is charged (docs/design.md, security):
//   - a job's state and staging, its per-tensor and per-rank bookkeeping
//     and its window, at CreateJob (JobStore), leaving kept_for_streams()
//     free for the rest;
//   - each round's barrier tracking as it grows, per rank that pushes
//     (push_session.cc);
//   - each stream message from its arrival until it is dealt with
//     (read_reactor.cc);
//   - a checkpoint's writer buffers while it writes (JobStore; not the
//     SIGTERM drain's, which must not fail for want of them).
// Charges are RAII: a dropped job, an ended round, a finished message and a
// finished checkpoint give theirs back.
#pragma once

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardopt {

class MemoryBudget {
 public:
  explicit MemoryBudget(uint64_t limit_bytes) : limit_(limit_bytes) {}
  MemoryBudget(const MemoryBudget&) = delete;
  MemoryBudget& operator=(const MemoryBudget&) = delete;

  // The default limit: the smaller of physical memory and the limits of this
  // process's cgroup and its ancestors (v2 memory.max, or v1
  // memory.limit_in_bytes, found through /proc/self/cgroup), less a
  // headroom of an eighth (at least 256 MiB) for what is not charged: the
  // binary, threads, gRPC's buffers, the allocator's slack. `found` says
  // where the figure came from.
  static uint64_t DefaultLimit(std::string* found = nullptr);
  // "auto", or bytes with an optional suffix: K M G T (powers of 1000) or
  // Ki Mi Gi Ti (powers of 1024), as in Kubernetes, from kLeastLimit up to
  // what the process may use. `found` says where the figure came from, as
  // DefaultLimit's does.
  static constexpr uint64_t kLeastLimit = uint64_t{64} << 20;
  static absl::StatusOr<uint64_t> ParseLimit(absl::string_view text, std::string* found = nullptr);
  // A positive byte count in digits with an optional suffix, as
  // ParseLimit's; nullopt if `text` is not one.
  static std::optional<uint64_t> ParseBytes(absl::string_view text);

  // Bytes held against the budget; returned when destroyed.
  class Charge {
   public:
    Charge() = default;
    Charge(Charge&& other) noexcept : budget_(other.budget_), bytes_(other.bytes_) { other.bytes_ = 0; }
    Charge& operator=(Charge&& other) noexcept;
    ~Charge() { Release(); }

    uint64_t bytes() const { return bytes_; }
    // Charges `more` bytes for `what`; RESOURCE_EXHAUSTED, changing nothing,
    // if they do not fit. A default-constructed charge has no budget.
    absl::Status Grow(uint64_t more, absl::string_view what);
    // Gives back `less` of the bytes (at most all).
    void Shrink(uint64_t less);
    void Release() { Shrink(bytes_); }

   private:
    friend class MemoryBudget;
    Charge(MemoryBudget* budget, uint64_t bytes) : budget_(budget), bytes_(bytes) {}
    MemoryBudget* budget_ = nullptr;
    uint64_t bytes_ = 0;
  };

  // A charge of `bytes` for `what`, or RESOURCE_EXHAUSTED.
  absl::StatusOr<Charge> Reserve(uint64_t bytes, absl::string_view what);
  // Reserve for a job, which must leave kept_for_streams() free: the jobs a
  // server holds can then still be pushed (each message is charged) and
  // checkpointed (a Checkpoint call's buffers are) when jobs have filled the
  // rest, however large the last one admitted.
  absl::StatusOr<Charge> ReserveForJob(uint64_t bytes, absl::string_view what);
  // A quarter of the limit, but at least kKeptAtLeast (one checkpoint's
  // buffers) and at most 64 MiB, and never over half the limit.
  uint64_t kept_for_streams() const;
  static constexpr uint64_t kKeptAtLeast = uint64_t{32} << 20;
  // Below it, half the limit would not hold kKeptAtLeast.
  static_assert(kLeastLimit == 2 * kKeptAtLeast);
  // A charge of nothing yet, to Grow later.
  Charge Empty() { return Charge(this, 0); }

  uint64_t limit() const { return limit_; }
  uint64_t used() const { return used_.load(std::memory_order_relaxed); }

 private:
  absl::Status Take(uint64_t bytes, absl::string_view what, uint64_t keep_free = 0);
  void Give(uint64_t bytes) { used_.fetch_sub(bytes, std::memory_order_relaxed); }

  const uint64_t limit_;
  std::atomic<uint64_t> used_{0};
};

}  // namespace shardopt
