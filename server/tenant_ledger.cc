#include "server/tenant_ledger.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"

namespace shardopt {

TenantLedger::Charge& TenantLedger::Charge::operator=(Charge&& other) noexcept {
  if (this != &other) {
    Release();
    ledger_ = std::exchange(other.ledger_, nullptr);
    owner_ = std::move(other.owner_);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void TenantLedger::Charge::Release() {
  if (ledger_ == nullptr) return;
  absl::MutexLock lock(&ledger_->mu_);
  // Every charge's bytes are in its owner's entry, which only a charge's
  // release makes 0 and erases (a charge of no bytes may find it gone).
  if (auto it = ledger_->held_.find(owner_); it != ledger_->held_.end() && (it->second -= bytes_) == 0) {
    ledger_->held_.erase(it);
  }
  ledger_ = nullptr;
  bytes_ = 0;
}

absl::StatusOr<TenantLedger::Charge> TenantLedger::Reserve(const JobOwner& owner, uint64_t bytes,
                                                           absl::string_view what) {
  if (owner.name.empty()) return Charge();  // made without tokens: nobody's
  absl::MutexLock lock(&mu_);
  uint64_t& held = held_[owner.name];
  if (owner.max_bytes > 0 && bytes > owner.max_bytes - std::min(held, owner.max_bytes)) {
    const uint64_t before = held;
    if (held == 0) held_.erase(owner.name);
    return absl::ResourceExhaustedError(absl::StrCat(
        "'", owner.name, "' may hold ", owner.max_bytes, " bytes of jobs on this server (max_memory in the tokens ",
        "file); its jobs hold ", before, ", and ", what, " ", bytes, ": drop one of its jobs, or raise its ",
        "max_memory"));
  }
  held += bytes;
  Charge charge;
  charge.ledger_ = this;
  charge.owner_ = owner.name;
  charge.bytes_ = bytes;
  return charge;
}

std::vector<std::pair<std::string, uint64_t>> TenantLedger::Held() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::pair<std::string, uint64_t>> held;
  for (const auto& [owner, bytes] : held_) {
    if (bytes > 0) held.emplace_back(owner, bytes);
  }
  return held;
}

}  // namespace shardopt
