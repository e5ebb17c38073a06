// One thread that runs callbacks, now or at a steady-clock time: how a push
// that must wait (for room in the running sum's window, or at the barrier)
// is resumed without holding a thread of its own while it waits. The server
// then serves any number of waiting streams with a fixed set of threads.
#pragma once

#include <chrono>
#include <functional>
#include <queue>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace shardopt {

class Wakeups {
 public:
  using Clock = std::chrono::steady_clock;

  Wakeups();
  // Runs nothing more; callbacks not yet due are dropped.
  ~Wakeups();
  Wakeups(const Wakeups&) = delete;
  Wakeups& operator=(const Wakeups&) = delete;

  // Runs `fn` on the wakeup thread, soon. Safe from any thread, also with
  // any other lock held: it only queues.
  void Post(std::function<void()> fn) { At(Clock::time_point::min(), std::move(fn)); }
  // Runs `fn` on the wakeup thread once the steady clock reaches `when`.
  void At(Clock::time_point when, std::function<void()> fn);

 private:
  struct Due {
    Clock::time_point when;
    uint64_t order;  // first queued, first run among equal times
    std::function<void()> fn;
    bool operator>(const Due& o) const { return when != o.when ? when > o.when : order > o.order; }
  };
  void Run();
  bool Ready() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  std::priority_queue<Due, std::vector<Due>, std::greater<Due>> due_ ABSL_GUARDED_BY(mu_);
  uint64_t queued_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace shardopt
