#include "server/write_watch.h"

#include "grpcpp/server_context.h"

namespace shardopt {

WriteWatch::WriteWatch(grpc::CallbackServerContext* context, Wakeups* wakeups, absl::Duration idle_timeout)
    : state_(std::make_shared<State>()), wakeups_(wakeups), timeout_(absl::ToChronoNanoseconds(idle_timeout)) {
  state_->context = context;
}

// One timer per call at a time, not one per write: a commit writes a piece
// every few milliseconds, and each timer would wait in the server's one
// wakeup queue for the whole timeout.
void WriteWatch::Started() {
  std::lock_guard<std::recursive_mutex> lock(state_->mu);
  state_->waiting = true;
  state_->since = Clock::now();
  if (!state_->armed) Arm(state_, wakeups_, state_->since + timeout_, timeout_);
}

void WriteWatch::Arm(const std::shared_ptr<State>& state, Wakeups* wakeups, Clock::time_point when,
                     Clock::duration timeout) {
  state->armed = true;
  wakeups->At(when, [weak = std::weak_ptr<State>(state), wakeups, timeout] {
    const std::shared_ptr<State> state = weak.lock();
    if (state == nullptr) return;
    std::lock_guard<std::recursive_mutex> lock(state->mu);
    state->armed = false;
    if (state->context == nullptr || !state->waiting) return;  // done, or no write waits: the next arms
    const Clock::time_point due = state->since + timeout;
    if (Clock::now() < due) return Arm(state, wakeups, due, timeout);  // a later write: its own time
    state->cut = true;
    state->context->TryCancel();
  });
}

void WriteWatch::Ended() {
  std::lock_guard<std::recursive_mutex> lock(state_->mu);
  state_->waiting = false;
}

void WriteWatch::Done() {
  std::lock_guard<std::recursive_mutex> lock(state_->mu);
  state_->context = nullptr;
}

bool WriteWatch::cut() const {
  std::lock_guard<std::recursive_mutex> lock(state_->mu);
  return state_->cut;
}

}  // namespace shardopt
