#include "server/checkpoint_buffers.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace shardopt {

CheckpointBuffers::Held& CheckpointBuffers::Held::operator=(Held&& other) noexcept {
  if (this != &other) {
    GiveBack();
    owner_ = std::exchange(other.owner_, nullptr);
    charge_ = std::move(other.charge_);
  }
  return *this;
}

void CheckpointBuffers::Held::GiveBack() {
  if (owner_ == nullptr) return;
  charge_.Release();  // before a waiter is woken to take it
  std::exchange(owner_, nullptr)->Returned();
}

void CheckpointBuffers::Returned() {
  absl::MutexLock lock(&mu_);
  --held_;
  ++returned_;
}

void CheckpointBuffers::StopWaiting(absl::Status why) {
  absl::MutexLock lock(&mu_);
  stopped_ = std::move(why);
}

absl::StatusOr<CheckpointBuffers::Held> CheckpointBuffers::Take(uint64_t bytes, absl::string_view what,
                                                                absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  const absl::Time began = absl::Now();
  for (;;) {
    absl::StatusOr<MemoryBudget::Charge> charge = budget_->Reserve(bytes, what);
    if (charge.ok()) {
      ++held_;
      return Held(this, *std::move(charge));
    }
    if (!stopped_.ok()) return stopped_;
    if (held_ == 0) return charge.status();
    const uint64_t seen = returned_;
    auto changed = [this, seen]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return returned_ != seen || !stopped_.ok(); };
    if (!mu_.AwaitWithDeadline(absl::Condition(&changed), deadline)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          charge.status().message(), "; waited ", absl::FormatDuration(absl::Now() - began),
          ", until the call's deadline, for the checkpoints of other jobs writing on this server to give theirs back"));
    }
  }
}

}  // namespace shardopt
