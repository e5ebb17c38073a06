#include "server/push_reactor.h"

#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "rpc/grpc_edge.h"
#include "server/grad_message.h"
#include "server/metrics.h"
#include "server/read_reactor.h"

namespace shardopt {
namespace {

// Kept alive by itself until gRPC's OnDone (read_reactor.h), and by every
// wake the session holds: a wake that runs after the call ended finds it
// finished and does nothing.
class PushReactor final : public ReadReactor {
 public:
  PushReactor(JobStore* store, grpc::CallbackServerContext* context, grpc::ByteBuffer* response, CallerCheck allows,
              StreamSettings settings)
      : ReadReactor("push", context, store->wakeups(), std::move(settings)),
        store_(store), response_(response), allows_(std::move(allows)) {}

 private:
  enum class Waiting { kNothing, kWindow, kRead, kBarrier };

  void OnMessage(grpc::ByteBuffer* message) override {
    // The gradient bytes stay in the message's slices, which `data` now
    // holds, until they are folded into the running sum or copied into the
    // window: a waiting push keeps one copy, not two.
    v1::GradChunk chunk;  // the message's fields but its data and its packed chunks
    Pieces data;
    std::vector<GradPart> more;
    const uint64_t allowed = session_ ? session_->no_grad_names_left() : store_->max_tensors_per_job();
    const uint64_t packs = session_ ? session_->packed_chunks_allowed() : store_->max_tensors_per_job();
    if (absl::Status read = ReadGradChunk(message, allowed, packs, &chunk, &data, &more); !read.ok()) {
      if (session_) session_->Refuse();
      return Stop(ToGrpcStatus(read));
    }
    // What the packed chunks cost beside the message's bytes, for as long.
    if (absl::Status charged = ChargeMessage(more.size() * kPackedChunkCharge); !charged.ok()) {
      if (session_) session_->Refuse();
      return Stop(ToGrpcStatus(charged));
    }
    // Asked at every message, as the tokens are now (auth.h).
    if (absl::Status authorized = allows_(Action::kPush, session_ ? job_ : chunk.job()); !authorized.ok()) {
      if (session_) session_->Refuse();
      return Stop(ToGrpcStatus(authorized));
    }
    if (!session_) {
      auto session = store_->BeginPush(chunk);
      if (!session.ok()) return Stop(ToGrpcStatus(session.status()));
      session_ = *std::move(session);
      job_ = chunk.job();
    }
    if (!session_->ReadAhead()) {
      return Taken(session_->Offer(std::move(chunk), std::move(data), std::move(more), Wake()));
    }
    // The lowest rank's chunks fold at once, so its next message is read
    // while this one folds: gRPC receives it meanwhile instead of after.
    // This message's charge is kept until it is folded.
    const MemoryBudget::Charge charge = TakeMessageCharge();
    Read();
    absl::StatusOr<bool> taken = session_->Offer(std::move(chunk), std::move(data), std::move(more), Wake());
    if (!taken.ok()) return Stop(ToGrpcStatus(taken.status()));
    if (!*taken) return Stop(grpc::Status(grpc::StatusCode::INTERNAL, "the lowest rank's chunk waited for the window"));
  }

  void OnClosed() override {
    if (!session_) return Stop(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "empty push stream"));
    Seal();
  }

  std::string OnCut(bool by_server) override {
    // Cancelled, what was summed stays for the client's retry; cut by the
    // server, the stream is refused (push_session.h).
    if (session_ && by_server) session_->Refuse();
    session_.reset();
    return "its round is left as after a refused push: push the step again";
  }

  std::optional<Clock::time_point> CutOffAt() override {
    return session_ ? session_->RoundDeadline() : std::nullopt;
  }
  absl::Status AtCutOff() override { return session_ ? session_->CheckRound() : absl::OkStatus(); }

  PushSession::Wake Wake() {
    return [weak = WeakSelf<PushReactor>()] {
      if (auto self = weak.lock()) self->Woken();
    };
  }

  void Woken() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    if (finished()) return;
    if (waiting_ == Waiting::kWindow) {
      waiting_ = Waiting::kNothing;
      Taken(session_->Resume(Wake()));
    } else if (waiting_ == Waiting::kRead) {
      waiting_ = Waiting::kNothing;
      ReadWhenAllowed();
    } else if (waiting_ == Waiting::kBarrier) {
      waiting_ = Waiting::kNothing;
      Seal();
    }
  }

  void Taken(const absl::StatusOr<bool>& taken) {
    if (!taken.ok()) return Stop(ToGrpcStatus(taken.status()));
    if (!*taken) {
      waiting_ = Waiting::kWindow;
      return;
    }
    // Summed, or copied into the window: the message's charge goes now,
    // not at the next read, which may wait for room (it used to stay
    // charged to the budget beside the copy in the window, which the job's
    // staging charge holds).
    ReleaseMessage();
    ReadWhenAllowed();
  }

  // The next message is read only when the job's pushes hold little enough
  // (PushSession::MayRead); until then gRPC's flow control holds it back in
  // the sender.
  void ReadWhenAllowed() {
    auto may = session_->MayRead(Wake());
    if (!may.ok()) return Stop(ToGrpcStatus(may.status()));
    if (!*may) {
      waiting_ = Waiting::kRead;
      return;
    }
    Read();
  }

  void Seal() {
    auto answer = session_->TrySeal(Wake());
    if (!answer.ok()) return Stop(ToGrpcStatus(answer.status()));
    if (!*answer) {
      waiting_ = Waiting::kBarrier;
      return;
    }
    *response_ = SerializeMessage(**answer);
    Stop(grpc::Status::OK);
  }

  // The session leaves the round before the client hears the answer: a
  // refused or cancelled stream's chunks are withdrawn (or its round ended)
  // now, not at OnDone, which may come after the client's retry arrives,
  // and the retry would find them still counted.
  void Stop(const grpc::Status& status) {
    waiting_ = Waiting::kNothing;
    session_.reset();
    End(status);
  }

  JobStore* const store_;
  grpc::ByteBuffer* const response_;
  const CallerCheck allows_;
  std::unique_ptr<PushSession> session_;
  std::string job_;  // the session's, named by the stream's first message
  Waiting waiting_ = Waiting::kNothing;
};

}  // namespace

grpc::ServerReadReactor<grpc::ByteBuffer>* StartPushReactor(JobStore* store, grpc::CallbackServerContext* context,
                                                            grpc::ByteBuffer* response, CallerCheck allows,
                                                            StreamSettings settings) {
  return StartReadReactor<PushReactor>(store, context, response, std::move(allows), std::move(settings));
}

}  // namespace shardopt
