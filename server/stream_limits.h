// Caps on the streams open at once, on the whole server and per client, so
// that one client holding streams open cannot take every slot. A client is
// its token's name, or its address when the server takes no tokens.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace shardopt {

class StreamLimits {
 public:
  // 0: no cap.
  StreamLimits(uint32_t max_streams, uint32_t max_streams_per_client)
      : max_(max_streams), max_per_client_(max_streams_per_client) {}

  // Held by a stream while it is open; its release frees the slot.
  class Slot {
   public:
    ~Slot();
    Slot(const Slot&) = delete;
    Slot& operator=(const Slot&) = delete;

   private:
    friend class StreamLimits;
    Slot(StreamLimits* limits, std::string client) : limits_(limits), client_(std::move(client)) {}
    StreamLimits* const limits_;
    const std::string client_;
  };

  // RESOURCE_EXHAUSTED naming the cap and its flag when either is reached.
  absl::StatusOr<std::unique_ptr<Slot>> Open(const std::string& client) ABSL_LOCKS_EXCLUDED(mu_);
  uint32_t open() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Close(const std::string& client) ABSL_LOCKS_EXCLUDED(mu_);

  const uint32_t max_;
  const uint32_t max_per_client_;
  mutable absl::Mutex mu_;
  uint32_t open_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, uint32_t> per_client_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardopt
