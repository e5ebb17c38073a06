#include "server/push_reactor.h"

#include <memory>
#include <mutex>
#include <optional>
#include <utility>

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
  PushReactor(JobStore* store, grpc::CallbackServerContext* context, grpc::ByteBuffer* response)
      : store_(store), context_(context), response_(response) {}

  void Begin() {
    self_ = shared_from_this();
    std::lock_guard<std::recursive_mutex> lock(mu_);
    StartRead(&message_);
  }

  void OnReadDone(bool ok) override {
    std::lock_guard<std::recursive_mutex> lock(mu_);
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
    StartRead(&message_);
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
  bool finished_ = false;  // Finish was called
  bool done_ = false;      // OnDone ran
};

}  // namespace

grpc::ServerReadReactor<grpc::ByteBuffer>* StartPushReactor(JobStore* store, grpc::CallbackServerContext* context,
                                                            grpc::ByteBuffer* response) {
  auto reactor = std::make_shared<PushReactor>(store, context, response);
  reactor->Begin();
  return reactor.get();
}

}  // namespace shardopt
