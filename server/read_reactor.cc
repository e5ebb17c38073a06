#include "server/read_reactor.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "rpc/grpc_edge.h"
#include "server/metrics.h"

namespace shardopt {

ReadReactor::ReadReactor(const char* what, grpc::CallbackServerContext* context, Wakeups* wakeups,
                         StreamSettings settings)
    : context_(context), what_(what), wakeups_(wakeups),
      idle_timeout_(absl::ToChronoNanoseconds(settings.idle_timeout)), slot_(std::move(settings.slot)),
      budget_(settings.budget), charge_what_(absl::StrCat("one ", what, " message")),
      received_(metrics::Registry::Default().Series("shardopt_received_bytes_total", {{"method", what}})) {}

void ReadReactor::Begin() {
  self_ = shared_from_this();
  std::lock_guard<std::recursive_mutex> lock(mu_);
  // A client in the tarpit (stream_limits.h) waits before its first read.
  const Clock::duration penalty = slot_ ? slot_->Penalty() : Clock::duration::zero();
  if (penalty <= Clock::duration::zero()) return Read();
  wakeups_->At(Clock::now() + penalty, [weak = std::weak_ptr<ReadReactor>(shared_from_this())] {
    if (auto self = weak.lock()) {
      std::lock_guard<std::recursive_mutex> lock(self->mu_);
      if (!self->finished_ && !self->done_) self->Read();
    }
  });
}

void ReadReactor::OnReadDone(bool ok) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  reading_ = false;
  if (finished_) return;
  if (ok) {
    auto charge = budget_->Reserve(message_.Length(), charge_what_);
    if (!charge.ok()) {
      message_.Clear();
      OnCut(true);
      return End(ToGrpcStatus(charge.status()));
    }
    message_charge_ = *std::move(charge);
    received_->Add(static_cast<double>(message_.Length()));
    return OnMessage(&message_);
  }
  if (context_->IsCancelled()) {
    OnCut(false);
    return End(grpc::Status(grpc::StatusCode::CANCELLED, absl::StrCat(what_, " cancelled")));
  }
  OnClosed();
}

void ReadReactor::OnCancel() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  // A read in flight completes with !ok and ends the call there; a wait of
  // the server's (for the window, at the barrier) ends here.
  if (!reading_ && !finished_) {
    OnCut(false);
    End(grpc::Status(grpc::StatusCode::CANCELLED, absl::StrCat(what_, " cancelled")));
  }
}

void ReadReactor::OnDone() {
  {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    done_ = true;
    slot_.reset();
  }
  self_.reset();  // last: may destroy this
}

// The timers: at most one pending per distinct time, and one re-armed from
// the latest read's start when it fires early.
void ReadReactor::Read() {
  ReleaseMessage();  // the last message is dealt with
  reading_ = true;
  read_started_ = Clock::now();
  Clock::time_point due = read_started_ + idle_timeout_;
  if (const auto cut = CutOffAt(); cut && *cut > read_started_) due = std::min(due, *cut);
  if (due < armed_for_) Arm(due);
  StartRead(&message_);
}

void ReadReactor::ReleaseMessage() {
  message_charge_.Release();
  message_.Clear();
}

void ReadReactor::Arm(Clock::time_point when) {
  armed_for_ = when;
  wakeups_->At(when, [weak = std::weak_ptr<ReadReactor>(shared_from_this()), when] {
    if (auto self = weak.lock()) self->TimerFired(when);
  });
}

void ReadReactor::TimerFired(Clock::time_point when) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  if (armed_for_ <= when) armed_for_ = Clock::time_point::max();  // timers fire in time order
  if (done_ || finished_ || !reading_) return;
  const auto now = Clock::now();
  const auto cut = CutOffAt();
  if (cut && now >= *cut) {
    if (absl::Status st = AtCutOff(); !st.ok()) {
      OnCut(true);
      return End(ToGrpcStatus(st));
    }
  }
  const auto idle_due = read_started_ + idle_timeout_;
  if (now >= idle_due) {
    const std::string advice = OnCut(true);
    return End(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                            absl::StrCat("the ", what_, " stream sent nothing for ",
                                         absl::FormatDuration(absl::FromChrono(idle_timeout_)),
                                         " (--idle_stream_timeout_ms); it is cancelled: ", advice)));
  }
  Clock::time_point due = idle_due;
  if (cut && *cut > now) due = std::min(due, *cut);
  if (due < armed_for_) Arm(due);
}

void ReadReactor::End(const grpc::Status& status) {
  if (finished_) return;
  finished_ = true;
  switch (status.error_code()) {
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::NOT_FOUND:
    case grpc::StatusCode::PERMISSION_DENIED:
      if (slot_) slot_->Strike();  // bad input: counts toward the tarpit
      break;
    default:
      break;
  }
  message_charge_.Release();
  // The slot goes back as the answer does, not at OnDone, which may come
  // after the client has its answer and opened its next stream.
  slot_.reset();
  Finish(status);
}

}  // namespace shardopt
