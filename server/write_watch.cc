#include "server/write_watch.h"

#include "grpcpp/server_context.h"

namespace shardopt {

WriteWatch::WriteWatch(grpc::CallbackServerContext* context, Wakeups* wakeups, absl::Duration idle_timeout)
    : state_(std::make_shared<State>()), wakeups_(wakeups), timeout_(absl::ToChronoNanoseconds(idle_timeout)) {
  state_->context = context;
}

void WriteWatch::Started() {
  uint64_t write;
  {
    std::lock_guard<std::recursive_mutex> lock(state_->mu);
    write = ++state_->writes;
    state_->waiting = true;
  }
  wakeups_->At(std::chrono::steady_clock::now() + timeout_, [weak = std::weak_ptr<State>(state_), write] {
    const std::shared_ptr<State> state = weak.lock();
    if (state == nullptr) return;
    std::lock_guard<std::recursive_mutex> lock(state->mu);
    // This very write still waits, on a call that is not done.
    if (state->context == nullptr || !state->waiting || state->writes != write) return;
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
