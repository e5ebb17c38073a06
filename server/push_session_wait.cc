// The blocking forms of PushSession's Offer and TrySeal (push_session.h),
// for callers with a thread to spare: tests and in-process tools.
#include <memory>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "base/status_macros.h"
#include "server/push_session.h"

namespace shardopt {
namespace {

// A blocking caller's wait: the wake sets the flag. Shared, because a wake
// already posted may run after the caller returned.
struct Latch {
  absl::Mutex mu;
  bool woken ABSL_GUARDED_BY(mu) = false;
  void Wait() {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(&woken));
    woken = false;
  }
  static PushSession::Wake WakeOf(const std::shared_ptr<Latch>& latch) {
    return [latch] {
      absl::MutexLock lock(&latch->mu);
      latch->woken = true;
    };
  }
};

}  // namespace

absl::Status PushSession::Add(v1::GradChunk head, Pieces data) {
  std::vector<GradPart> more;
  for (v1::GradChunk& packed : *head.mutable_more()) {
    Pieces bytes = Pieces::Own(std::move(*packed.mutable_data()));
    packed.clear_data();
    more.push_back({std::move(packed), std::move(bytes)});
  }
  head.clear_more();
  auto latch = std::make_shared<Latch>();
  const Wake wake = Latch::WakeOf(latch);
  absl::StatusOr<bool> done = Offer(std::move(head), std::move(data), std::move(more), wake);
  while (done.ok() && !*done) {
    latch->Wait();
    done = Resume(wake);
  }
  return done.status();
}

absl::Status PushSession::Add(const v1::GradChunk& chunk) {
  v1::GradChunk head = chunk;
  head.clear_data();
  return Add(std::move(head), Pieces::Own(chunk.data()));
}

absl::StatusOr<v1::PushResponse> PushSession::Finish() {
  auto latch = std::make_shared<Latch>();
  const Wake wake = Latch::WakeOf(latch);
  for (;;) {
    SHARDOPT_ASSIGN_OR_RETURN(auto answer, TrySeal(wake));
    if (answer) return *std::move(answer);
    latch->Wait();
  }
}

}  // namespace shardopt
