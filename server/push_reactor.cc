#include "server/push_reactor.h"

#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/server_context.h"
#include "rpc/grpc_edge.h"

namespace shardopt {
namespace {

// Kept alive by itself until gRPC's OnDone, and by every wake the session
// holds: a wake that runs after the call ended finds `done_` and does
// nothing. Every reactor step runs under `mu_`, so a wake never races a
// read's completion.
class PushReactor final : public grpc::ServerReadReactor<grpc::ByteBuffer>,
                          public std::enable_shared_from_this<PushReactor> {
 public:
  PushReactor(JobStore* store, grpc::CallbackServerContext* context, grpc::ByteBuffer* response,
              absl::Duration idle_timeout)
      : store_(store), context_(context), response_(response),
        idle_timeout_(absl::ToChronoNanoseconds(idle_timeout)) {}

  void Begin() {
    self_ = shared_from_this();
    std::lock_guard<std::recursive_mutex> lock(mu_);
    Read();
  }

  void OnReadDone(bool ok) override {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    reading_ = false;
    if (finished_) return;
    if (!ok) {  // the client closed its side (or the call broke): seal
      if (context_->IsCancelled()) return End(grpc::Status(grpc::StatusCode::CANCELLED, "push cancelled"));
      if (!session_) return End(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "empty push stream"));
      return Seal();
    }
    if (absl::Status parsed = ParseMessage(&message_, &chunk_, "GradChunk"); !parsed.ok()) {
      if (session_) session_->Refuse();
      return End(ToGrpcStatus(parsed));
    }
    message_.Clear();  // the chunk holds its bytes now; a waiting push keeps one copy, not two
    if (!session_) {
      auto session = store_->BeginPush(chunk_);
      if (!session.ok()) return End(ToGrpcStatus(session.status()));
      session_ = *std::move(session);
    }
    Taken(session_->Offer(std::move(chunk_), Wake()));
  }

  void OnCancel() override {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    // A read in flight completes with !ok and ends the call there; a wait
    // for the window or the barrier ends here.
    if (waiting_ != Waiting::kNothing) End(grpc::Status(grpc::StatusCode::CANCELLED, "push cancelled"));
  }

  void OnDone() override {
    {
      std::lock_guard<std::recursive_mutex> lock(mu_);
      done_ = true;
    }
    self_.reset();  // last: may destroy this
  }

 private:
  enum class Waiting { kNothing, kWindow, kBarrier };

  PushSession::Wake Wake() {
    return [weak = std::weak_ptr<PushReactor>(shared_from_this())] {
      if (auto self = weak.lock()) self->Woken();
    };
  }

  void Woken() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    if (done_ || finished_) return;
    if (waiting_ == Waiting::kWindow) {
      waiting_ = Waiting::kNothing;
      Taken(session_->Resume(Wake()));
    } else if (waiting_ == Waiting::kBarrier) {
      waiting_ = Waiting::kNothing;
      Seal();
    }
  }

  void Taken(const absl::StatusOr<bool>& taken) {
    if (!taken.ok()) return End(ToGrpcStatus(taken.status()));
    if (!*taken) {
      waiting_ = Waiting::kWindow;
      return;
    }
    Read();
  }

  // Reads the next message, with one idle timer per stream at a time,
  // re-armed from the latest read's start when it fires early.
  void Read() {
    reading_ = true;
    read_started_ = std::chrono::steady_clock::now();
    if (!idle_armed_) ArmIdle(read_started_ + idle_timeout_);
    StartRead(&message_);
  }

  void ArmIdle(std::chrono::steady_clock::time_point when) {
    idle_armed_ = true;
    store_->wakeups()->At(when, [weak = std::weak_ptr<PushReactor>(shared_from_this())] {
      if (auto self = weak.lock()) self->IdleCheck();
    });
  }

  void IdleCheck() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    idle_armed_ = false;
    if (done_ || finished_ || !reading_) return;
    const auto due = read_started_ + idle_timeout_;
    if (std::chrono::steady_clock::now() < due) return ArmIdle(due);
    if (session_) session_->Refuse();
    End(grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                     absl::StrCat("the push stream sent nothing for ",
                                  absl::FormatDuration(absl::FromChrono(idle_timeout_)),
                                  " (--idle_stream_timeout_ms); it is cancelled and its round left as after a "
                                  "refused push: push the step again")));
  }

  void Seal() {
    auto answer = session_->TrySeal(Wake());
    if (!answer.ok()) return End(ToGrpcStatus(answer.status()));
    if (!*answer) {
      waiting_ = Waiting::kBarrier;
      return;
    }
    *response_ = SerializeMessage(**answer);
    End(grpc::Status::OK);
  }

  void End(const grpc::Status& status) {
    if (finished_) return;
    finished_ = true;
    waiting_ = Waiting::kNothing;
    // The session leaves the round before the client hears the answer: a
    // refused or cancelled stream's chunks are withdrawn (or its round ended)
    // now, not at OnDone, which may come after the client's retry arrives,
    // and the retry would find them still counted.
    session_.reset();
    Finish(status);
  }

  JobStore* const store_;
  grpc::CallbackServerContext* const context_;
  grpc::ByteBuffer* const response_;
  std::shared_ptr<PushReactor> self_;

  // Recursive in case gRPC runs a reaction inline from a Start call.
  std::recursive_mutex mu_;
  grpc::ByteBuffer message_;
  v1::GradChunk chunk_;
  std::unique_ptr<PushSession> session_;
  Waiting waiting_ = Waiting::kNothing;
  const std::chrono::steady_clock::duration idle_timeout_;
  bool reading_ = false;     // a read is outstanding: the client's turn
  bool idle_armed_ = false;  // an idle timer is pending
  std::chrono::steady_clock::time_point read_started_;
  bool finished_ = false;  // Finish was called
  bool done_ = false;      // OnDone ran
};

}  // namespace

grpc::ServerReadReactor<grpc::ByteBuffer>* StartPushReactor(JobStore* store, grpc::CallbackServerContext* context,
                                                            grpc::ByteBuffer* response, absl::Duration idle_timeout) {
  auto reactor = std::make_shared<PushReactor>(store, context, response, idle_timeout);
  reactor->Begin();
  return reactor.get();
}

}  // namespace shardopt
