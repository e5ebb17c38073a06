// Hands a waiting reactor back to one of gRPC's threads. A job's wakes come
// on the wakeup thread (wakeups.h), which must do no real work itself (an
// apply, a read of the state); a wake sets an alarm due at once instead,
// whose callback runs on gRPC's thread.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "grpcpp/alarm.h"

namespace shardopt {

class GrpcHops {
 public:
  // Runs `fn` soon on one of gRPC's threads. Safe from any thread. The
  // owner must outlive every hop it asked for: a server reactor that waits
  // has not called Finish, so gRPC keeps it until then.
  void Soon(std::function<void()> fn) {
    std::lock_guard<std::mutex> lock(mu_);
    // One alarm per hop, each set once and kept: destroying a set alarm
    // would cancel it. Nothing else cancels them, so each fires.
    alarms_.push_back(std::make_unique<grpc::Alarm>());
    alarms_.back()->Set(gpr_now(GPR_CLOCK_MONOTONIC), [fn = std::move(fn)](bool) { fn(); });
  }

 private:
  std::mutex mu_;
  std::vector<std::unique_ptr<grpc::Alarm>> alarms_;
};

}  // namespace shardopt
