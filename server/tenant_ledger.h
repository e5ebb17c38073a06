// What each caller's jobs hold on this server, against the cap its token
// gives it (the tokens file's max_memory=, server/auth.h): one tenant
// cannot fill the server's memory budget and lock the others out of it.
// A job is charged to the caller that made it (a CreateJob that built or
// restored it), with the bytes Describe reports for it, state_bytes,
// staging_bytes and bookkeeping_bytes, which count the state wherever the
// backend holds it (the GPU's too, which the budget does not charge);
// attaching costs nothing.
// The charge is RAII, held by the job: a dropped job gives it back when it
// goes.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace shardopt {

// Who makes a job, and the most the jobs it makes may hold here (0: no cap).
// No name (a server without tokens): nobody, charged nothing.
struct JobOwner {
  std::string name;
  uint64_t max_bytes = 0;
};

class TenantLedger {
 public:
  TenantLedger() = default;
  TenantLedger(const TenantLedger&) = delete;
  TenantLedger& operator=(const TenantLedger&) = delete;

  class Charge {
   public:
    Charge() = default;
    Charge(Charge&& other) noexcept { *this = std::move(other); }
    Charge& operator=(Charge&& other) noexcept;
    ~Charge() { Release(); }
    // Whose it is: JobOwner::name.
    const std::string& owner() const { return owner_; }

   private:
    friend class TenantLedger;
    void Release();
    TenantLedger* ledger_ = nullptr;
    std::string owner_;
    uint64_t bytes_ = 0;
  };

  // `bytes` more for `owner`'s job, or RESOURCE_EXHAUSTED, changing nothing,
  // when its jobs would then hold more than its cap. `what` says, before the
  // bytes, what needs them ("job 'x' needs").
  absl::StatusOr<Charge> Reserve(const JobOwner& owner, uint64_t bytes, absl::string_view what)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Every owner whose jobs hold anything now, and what they hold.
  std::vector<std::pair<std::string, uint64_t>> Held() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_map<std::string, uint64_t> held_ ABSL_GUARDED_BY(mu_);  // no entry: nothing held
};

}  // namespace shardopt
