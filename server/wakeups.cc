#include "server/wakeups.h"

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace shardopt {

Wakeups::Wakeups() : thread_([this] { Run(); }) {}

Wakeups::~Wakeups() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void Wakeups::At(Clock::time_point when, std::function<void()> fn) {
  absl::MutexLock lock(&mu_);
  due_.push({when, queued_++, std::move(fn)});
}

bool Wakeups::Ready() const { return stop_ || (!due_.empty() && due_.top().when <= Clock::now()); }

void Wakeups::Run() {
  absl::MutexLock lock(&mu_);
  for (;;) {
    if (stop_) return;
    const auto now = Clock::now();
    if (!due_.empty() && due_.top().when <= now) {
      std::function<void()> fn = due_.top().fn;
      due_.pop();
      mu_.Unlock();  // a callback may queue more
      fn();
      mu_.Lock();
      continue;
    }
    // absl's timed waits take the wall clock; waking at least every 100 ms
    // bounds what a step of it can do to a steady deadline.
    absl::Duration wait = absl::Milliseconds(100);
    if (!due_.empty()) wait = std::min(wait, absl::FromChrono(due_.top().when - now));
    mu_.AwaitWithTimeout(absl::Condition(this, &Wakeups::Ready), wait);
  }
}

}  // namespace shardopt
