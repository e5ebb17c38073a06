#include "client/fanout.h"

#include <string>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "rpc/barrier_timeout.h"

namespace shardopt::fanout {

namespace {
constexpr char kFanoutCancelledPayload[] = "type.shardopt.dev/fanout-cancelled";
}  // namespace

absl::Status FanoutCancelled(const std::string& address) {
  absl::Status st = absl::CancelledError(absl::StrCat(address, ": another server's call failed"));
  st.SetPayload(kFanoutCancelledPayload, absl::Cord());
  return st;
}

bool IsFanoutCancelled(const absl::Status& st) {
  return absl::IsCancelled(st) && st.GetPayload(kFanoutCancelledPayload).has_value();
}

bool Fanout::Register(grpc::ClientContext* ctx) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_) return false;
  active_.push_back(ctx);
  return true;
}

void Fanout::Unregister(grpc::ClientContext* ctx) {
  std::lock_guard<std::mutex> lock(mu_);
  active_.erase(std::find(active_.begin(), active_.end(), ctx));
}

void Fanout::Fail() {
  std::lock_guard<std::mutex> lock(mu_);
  failed_ = true;
  for (grpc::ClientContext* ctx : active_) ctx->TryCancel();
}

bool Fanout::failed() {
  std::lock_guard<std::mutex> lock(mu_);
  return failed_;
}

void AwaitChannel(grpc::Channel* channel, std::chrono::milliseconds pause) {
  const auto until = std::chrono::system_clock::now() + pause;
  // In slices, so that a fan-out that fails meanwhile is not kept waiting
  // for this thread's pause (up to kBackoffCapMs).
  constexpr auto kSlice = std::chrono::milliseconds(kBackoffBaseMs);
  for (auto now = std::chrono::system_clock::now(); now < until; now = std::chrono::system_clock::now()) {
    if (current != nullptr && current->failed()) return;
    const auto slice_end = std::min<std::chrono::system_clock::time_point>(until, now + kSlice);
    if (channel->GetState(false) == GRPC_CHANNEL_READY) {
      std::this_thread::sleep_until(slice_end);  // the server answered: give it the whole pause
    } else if (channel->WaitForConnected(slice_end)) {
      return;
    }
  }
}

absl::Status WithRetryAdvice(absl::Status st, int attempts) {
  const std::string tries = absl::StrCat(" (", attempts, attempts == 1 ? " attempt" : " attempts", "; ");
  if (absl::IsUnavailable(st)) {
    return absl::UnavailableError(absl::StrCat(st.message(), tries,
                                               "the server is down, unreachable or stopping, or refused the TLS "
                                               "handshake: this RPC is safe to retry once the server is back)"));
  }
  if (absl::IsCancelled(st)) {
    return absl::CancelledError(absl::StrCat(st.message(), tries,
                                             "the server cancelled the call: it is stopping, or this client read "
                                             "nothing for its idle timeout: this RPC is safe to retry)"));
  }
  // gRPC's own: no answer in time.
  if (absl::IsDeadlineExceeded(st) && absl::EndsWith(st.message(), ": Deadline Exceeded")) {
    return absl::DeadlineExceededError(absl::StrCat(st.message(), tries,
                                                    "no answer within the call's deadline: the server may be "
                                                    "overloaded or hung: this RPC is safe to retry)"));
  }
  // A server's (a barrier's) says what to do itself; but each attempt waited
  // the whole barrier, so the caller waited that many times over.
  if (attempts > 1 && IsBarrierTimeout(st)) {
    return absl::DeadlineExceededError(
        absl::StrCat(st.message(), tries, "each waited out the barrier's deadline for the ranks named)"));
  }
  return st;
}

}  // namespace shardopt::fanout
