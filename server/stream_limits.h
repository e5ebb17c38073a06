// Caps on the streams open at once, on the whole server and per client, so
// that one client holding streams open cannot take every slot. A client is
// its token's name, or its address when the server takes no tokens.
//
// And a tarpit: a client whose streams were refused for bad input more than
// kStrikesPerSecond times in a second has its next streams' first read held
// back for a second. Its writes then wait on gRPC's flow control, using no
// CPU on either side, instead of a flood of messages the server reads only
// to refuse. A well-behaved client is never refused that often.
#pragma once

#include <chrono>
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

    // The stream was refused for bad input.
    void Strike() { limits_->Strike(client_); }
    // How long the stream's first read waits: zero unless its client is in
    // the tarpit.
    std::chrono::steady_clock::duration Penalty() const { return limits_->Penalty(client_); }

   private:
    friend class StreamLimits;
    Slot(StreamLimits* limits, std::string client) : limits_(limits), client_(std::move(client)) {}
    StreamLimits* const limits_;
    const std::string client_;
  };

  // RESOURCE_EXHAUSTED naming the cap and its flag when either is reached.
  absl::StatusOr<std::unique_ptr<Slot>> Open(const std::string& client) ABSL_LOCKS_EXCLUDED(mu_);
  uint32_t open() const ABSL_LOCKS_EXCLUDED(mu_);

  static constexpr int kStrikesPerSecond = 20;

 private:
  void Close(const std::string& client) ABSL_LOCKS_EXCLUDED(mu_);
  void Strike(const std::string& client) ABSL_LOCKS_EXCLUDED(mu_);
  std::chrono::steady_clock::duration Penalty(const std::string& client) const ABSL_LOCKS_EXCLUDED(mu_);

  struct Strikes {
    std::chrono::steady_clock::time_point second;  // the start of the counting second
    int count = 0;
    std::chrono::steady_clock::time_point until;  // in the tarpit until then
  };

  const uint32_t max_;
  const uint32_t max_per_client_;
  mutable absl::Mutex mu_;
  uint32_t open_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, uint32_t> per_client_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::string, Strikes> strikes_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardopt
