// A server-streaming call (Commit, Read) whose caller stops reading: its
// writes wait on gRPC's flow control, and without a deadline of its own the
// call would hold its stream slot, and what it streams, for good. The watch
// cancels a call one of whose writes has waited --idle_stream_timeout_ms;
// the reactor's OnWriteDone(false) then ends it.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>

#include "absl/time/time.h"
#include "server/wakeups.h"

namespace grpc {
class CallbackServerContext;
}

namespace shardopt {

class WriteWatch {
 public:
  WriteWatch(grpc::CallbackServerContext* context, Wakeups* wakeups, absl::Duration idle_timeout);

  // A write was started, or is done.
  void Started();
  void Ended();
  // The call is done: its context is gone. Call from the reactor's OnDone.
  void Done();
  // Whether the watch cancelled the call.
  bool cut() const;

 private:
  using Clock = std::chrono::steady_clock;
  struct State {
    // Recursive: a reaction gRPC may run inline from TryCancel (OnWriteDone,
    // OnDone) takes it again on the same thread.
    std::recursive_mutex mu;
    grpc::CallbackServerContext* context;  // null once Done
    bool waiting = false;                  // a write is outstanding
    Clock::time_point since;               // when it was started
    bool armed = false;                    // a timer is pending
    bool cut = false;
  };
  // A timer at `when` that cuts the call if its write then waiting has
  // waited `timeout`, else arms again for it.
  static void Arm(const std::shared_ptr<State>& state, Wakeups* wakeups, Clock::time_point when,
                  Clock::duration timeout);

  const std::shared_ptr<State> state_;
  Wakeups* const wakeups_;
  const Clock::duration timeout_;
};

}  // namespace shardopt
