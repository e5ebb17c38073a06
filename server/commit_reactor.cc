#include "server/commit_reactor.h"

#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "grpcpp/server_context.h"
#include "grpcpp/support/slice.h"
#include "rpc/grpc_edge.h"
#include "rpc/wire_format.h"
#include "server/grpc_hop.h"
#include "server/metrics.h"
#include "server/write_watch.h"

namespace shardopt {
namespace {

class CommitReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  CommitReactor(JobStore* store, grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
                const Caller& caller, std::unique_ptr<StreamLimits::Slot> slot, absl::Duration idle_timeout)
      : store_(store), slot_(std::move(slot)), watch_(context, store->wakeups(), idle_timeout) {
    grpc::ByteBuffer copy = *request;  // shares the slices: ParseMessage reads it through
    if (absl::Status st = ParseMessage(&copy, &request_, "CommitRequest"); !st.ok()) {
      End(ToGrpcStatus(st));
      return;
    }
    if (absl::Status allowed = caller.Allows(Action::kCommit, request_.job()); !allowed.ok()) {
      End(ToGrpcStatus(allowed));
      return;
    }
    Open();
  }

  void OnWriteDone(bool ok) override {
    watch_.Ended();
    std::unique_lock<std::recursive_mutex> lock(mu_);
    in_flight_ = false;
    if (!ok) cancelled_ = true;  // the caller went away: the step is still completed
    if (applying_) return;       // the thread applying the next piece goes on from there
    Pump(lock);
  }

  // The stream's slot goes back as the answer does, not at OnDone, which
  // may come after the client has its answer and opened its next stream.
  void End(const grpc::Status& status) {
    slot_.reset();
    Finish(status);
  }

  void OnDone() override {
    watch_.Done();
    delete this;
  }

 private:
  // While a checkpoint streams the state, a commit that would start applying
  // waits without a thread; the store's wake opens it again on one of
  // gRPC's threads (grpc_hop.h). Nothing else happens to the reactor
  // meanwhile, and it lives until Finish.
  void Open() {
    auto stream = store_->OpenCommit(request_, [this] { hops_.Soon([this] { Open(); }); });
    if (!stream.ok()) {
      End(ToGrpcStatus(stream.status()));
      return;
    }
    if (*stream == nullptr) return;
    stream_ = *std::move(stream);
    std::unique_lock<std::recursive_mutex> lock(mu_);
    ApplyAhead(lock);  // the first piece
    Pump(lock);
  }

  // Called with no write in flight and no piece being applied, the next
  // piece in ahead_. Writes it, then applies the next while it goes out: the
  // update of piece k+1 overlaps the sending of piece k. Whichever of the two
  // ends last goes on.
  void Pump(std::unique_lock<std::recursive_mutex>& lock) {
    std::optional<grpc::Status> done;
    while (!done) {
      if (cancelled_) {
        ahead_ = std::nullopt;  // lets go of its hold
        stream_->Abandon().IgnoreError();
        done = grpc::Status(grpc::StatusCode::CANCELLED,
                            watch_.cut() ? "the caller read no params for the idle timeout (--idle_stream_timeout_ms): "
                                           "the commit is cancelled; its step is applied"
                                         : "the caller stopped reading the params");
        break;
      }
      auto piece = std::move(ahead_);
      if (!piece.ok() || !*piece) {
        done = piece.ok() ? grpc::Status::OK : ToGrpcStatus(piece.status());
        break;
      }
      in_flight_ = true;
      applying_ = true;  // before the write: its OnWriteDone leaves the going on to this thread
      Write(**piece);
      ApplyAhead(lock);
      if (in_flight_) return;  // OnWriteDone goes on
    }
    lock.unlock();
    End(*done);  // the last use of this reactor here: OnDone may delete it at once
  }

  void ApplyAhead(std::unique_lock<std::recursive_mutex>& lock) {
    applying_ = true;
    lock.unlock();
    auto next = stream_->Next();
    lock.lock();
    applying_ = false;
    ahead_ = std::move(next);
  }

  // The params go out as slices over the memory they lie in, each keeping
  // the piece's hold until gRPC has sent it (ParamStream::Piece::data).
  void Write(const ParamStream::Piece& p) {
    // Field order as protobuf writes it: tensor, offset, data, step, dtype.
    std::string head, tail;
    wire::AppendBytesField(&head, v1::ParamChunk::kTensorFieldNumber, *p.tensor);
    wire::AppendVarintField(&head, v1::ParamChunk::kOffsetFieldNumber, p.offset);
    wire::AppendBytesHeader(&head, v1::ParamChunk::kDataFieldNumber, p.data.size());
    wire::AppendVarintField(&tail, v1::ParamChunk::kStepFieldNumber, p.step);
    // BF16 is sent as unspecified, as servers sent it before param_dtype existed.
    if (p.fp32) wire::AppendVarintField(&tail, v1::ParamChunk::kDtypeFieldNumber, v1::FP32);
    std::vector<grpc::Slice> slices;
    slices.emplace_back(head);
    p.data.ForEachPart([&](const char* bytes, uint64_t n) {
      // Each slice owns a reference to the hold, dropped when gRPC is done with it.
      slices.emplace_back(const_cast<char*>(bytes), n, &ReleaseHold, new std::shared_ptr<const void>(p.data.owner()));
    });
    slices.emplace_back(tail);
    message_ = grpc::ByteBuffer(slices.data(), slices.size());
    static metrics::Counter* const sent =
        metrics::Registry::Default().Series("shardopt_sent_bytes_total", {{"method", "commit"}});
    sent->Add(static_cast<double>(message_.Length()));
    watch_.Started();
    StartWrite(&message_);
  }

  static void ReleaseHold(void* hold) { delete static_cast<std::shared_ptr<const void>*>(hold); }

  JobStore* const store_;
  std::unique_ptr<StreamLimits::Slot> slot_;
  WriteWatch watch_;
  v1::CommitRequest request_;
  // A commit is woken at any change of its job, so it may be turned back and
  // wait more than once while a checkpoint streams.
  GrpcHops hops_;
  std::unique_ptr<ParamStream> stream_;
  grpc::ByteBuffer message_;
  std::recursive_mutex mu_;
  absl::StatusOr<std::optional<ParamStream::Piece>> ahead_;  // the next piece (nullopt: none); these under mu_
  bool in_flight_ = false;
  bool applying_ = false;
  bool cancelled_ = false;
};

}  // namespace

grpc::ServerWriteReactor<grpc::ByteBuffer>* StartCommitReactor(JobStore* store, grpc::CallbackServerContext* context,
                                                               const grpc::ByteBuffer* request, const Caller& caller,
                                                               std::unique_ptr<StreamLimits::Slot> slot,
                                                               absl::Duration idle_timeout) {
  return new CommitReactor(store, context, request, caller, std::move(slot), idle_timeout);
}

}  // namespace shardopt
