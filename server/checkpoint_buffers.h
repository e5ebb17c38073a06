// The write buffers of Checkpoint calls, charged to the memory budget while
// a checkpoint writes. What jobs leave of the budget holds one checkpoint's
// buffers (MemoryBudget::kept_for_streams), so two jobs that checkpoint at
// once on a full server do not both fit: the second waits for the first to
// give its buffers back, until its deadline, instead of being refused
// RESOURCE_EXHAUSTED at once (and a trainer's checkpoint_every failing its
// step for a neighbour's checkpoint). A call with no other checkpoint to
// wait for is refused at once: streams' messages are what hold the budget
// then, and nothing says when they go.
#pragma once

#include <cstdint>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "server/memory_budget.h"

namespace shardopt {

class CheckpointBuffers {
 public:
  explicit CheckpointBuffers(MemoryBudget* budget) : budget_(budget) {}
  CheckpointBuffers(const CheckpointBuffers&) = delete;
  CheckpointBuffers& operator=(const CheckpointBuffers&) = delete;

  // One checkpoint's buffers, charged; given back when destroyed, which
  // lets a waiting Take try again.
  class Held {
   public:
    Held() = default;
    Held(Held&& other) noexcept : owner_(std::exchange(other.owner_, nullptr)), charge_(std::move(other.charge_)) {}
    Held& operator=(Held&& other) noexcept;
    ~Held() { GiveBack(); }

   private:
    friend class CheckpointBuffers;
    Held(CheckpointBuffers* owner, MemoryBudget::Charge charge) : owner_(owner), charge_(std::move(charge)) {}
    void GiveBack();
    CheckpointBuffers* owner_ = nullptr;
    MemoryBudget::Charge charge_;
  };

  // `bytes` for `what`. While the budget has no room and other checkpoints
  // hold buffers, waits for one to give them back, until `deadline`; then
  // RESOURCE_EXHAUSTED saying it waited. Without another checkpoint to wait
  // for, the budget's own refusal at once.
  absl::StatusOr<Held> Take(uint64_t bytes, absl::string_view what, absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);

  // From now on no Take waits: those waiting, and any that finds no room,
  // get `why`. For the SIGTERM drain, which checkpoints every job: a call
  // waiting its turn holds its job's checkpoint, and its end is no failure
  // to keep state.
  void StopWaiting(absl::Status why) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Returned() ABSL_LOCKS_EXCLUDED(mu_);

  MemoryBudget* const budget_;
  absl::Mutex mu_;
  uint32_t held_ ABSL_GUARDED_BY(mu_) = 0;
  // Counts buffers given back, so that a waiter sees one happen.
  uint64_t returned_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status stopped_ ABSL_GUARDED_BY(mu_);  // StopWaiting's `why`; OK until then
};

}  // namespace shardopt
