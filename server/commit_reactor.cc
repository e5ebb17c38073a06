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
    Build(lock);  // the first message
    Pump(lock);
  }

  // One piece as a ParamChunk's fields: `head` (tensor, offset, data's tag
  // and length), the data where it lies, `tail` (step, dtype), in the order
  // protobuf writes them.
  struct Encoded {
    ParamStream::Piece piece;
    std::string head, tail;
    uint64_t bytes() const { return head.size() + piece.data.size() + tail.size(); }
  };
  static Encoded Encode(ParamStream::Piece piece) {
    Encoded e{std::move(piece), {}, {}};
    wire::AppendBytesField(&e.head, v1::ParamChunk::kTensorFieldNumber, *e.piece.tensor);
    wire::AppendVarintField(&e.head, v1::ParamChunk::kOffsetFieldNumber, e.piece.offset);
    wire::AppendBytesHeader(&e.head, v1::ParamChunk::kDataFieldNumber, e.piece.data.size());
    wire::AppendVarintField(&e.tail, v1::ParamChunk::kStepFieldNumber, e.piece.step);
    // BF16 is sent as unspecified, as servers sent it before param_dtype existed.
    if (e.piece.fp32) wire::AppendVarintField(&e.tail, v1::ParamChunk::kDtypeFieldNumber, v1::FP32);
    return e;
  }
  // A piece's bytes inside another's message: as ParamChunk.more, whose tag
  // and length take at most 1 + 5 bytes more.
  static constexpr uint64_t kMoreOverhead = 6;

  // Called with no write in flight and nothing being applied, the next
  // message in next_ (empty: the stream ended, with error_). Writes it,
  // then builds the next one while it goes out: the update of message k+1's
  // pieces overlaps the sending of message k. Whichever of the two ends
  // last goes on.
  void Pump(std::unique_lock<std::recursive_mutex>& lock) {
    std::optional<grpc::Status> done;
    while (!done) {
      if (cancelled_) {
        next_.clear();  // lets go of their holds
        carry_.reset();
        stream_->Abandon().IgnoreError();
        done = grpc::Status(grpc::StatusCode::CANCELLED,
                            watch_.cut() ? "the caller read no params for the idle timeout (--idle_stream_timeout_ms): "
                                           "the commit is cancelled; its step is applied"
                                         : "the caller stopped reading the params");
        break;
      }
      if (next_.empty()) {
        done = ToGrpcStatus(error_);
        break;
      }
      const std::vector<Encoded> message = std::move(next_);
      next_.clear();
      in_flight_ = true;
      applying_ = true;  // before the write: its OnWriteDone leaves the going on to this thread
      Write(message);
      Build(lock);
      if (in_flight_) return;  // OnWriteDone goes on
    }
    lock.unlock();
    End(*done);  // the last use of this reactor here: OnDone may delete it at once
  }

  // Applies the pieces of the next message into next_: one piece, or for a
  // caller that reads packed messages (CommitRequest.pack) the pieces that
  // follow while they fit in JobStore::packed_message_bytes. A piece that
  // does not fit is kept, applied, for the message after. The stream's end
  // or error leaves next_ as far as it got and sets ended_ or error_.
  void Build(std::unique_lock<std::recursive_mutex>& lock) {
    applying_ = true;
    const uint64_t limit = request_.pack() ? store_->packed_message_bytes() : 0;
    uint64_t bytes = 0;
    while (!ended_ && error_.ok()) {
      if (!carry_) {
        lock.unlock();
        auto piece = stream_->Next();
        lock.lock();
        if (!piece.ok()) {
          error_ = piece.status();
          break;
        }
        if (!*piece) {
          ended_ = true;
          break;
        }
        carry_ = Encode(**std::move(piece));
      }
      const uint64_t adds = next_.empty() ? carry_->bytes() : kMoreOverhead + carry_->bytes();
      if (!next_.empty() && bytes + adds > limit) break;  // the message after starts with it
      bytes += adds;
      next_.push_back(*std::move(carry_));
      carry_.reset();
      if (bytes >= limit) break;
    }
    applying_ = false;
  }

  // The params go out as slices over the memory they lie in, each keeping
  // the piece's hold until gRPC has sent it (ParamStream::Piece::data). The
  // pieces after the first are its `more`; the fields between two pieces'
  // data share a slice.
  void Write(const std::vector<Encoded>& message) {
    std::vector<grpc::Slice> slices;
    std::string fields;
    for (size_t i = 0; i < message.size(); ++i) {
      const Encoded& e = message[i];
      if (i > 0) wire::AppendBytesHeader(&fields, v1::ParamChunk::kMoreFieldNumber, e.bytes());
      fields += e.head;
      slices.emplace_back(fields);
      e.piece.data.ForEachPart([&](const char* bytes, uint64_t n) {
        // Each slice owns a reference to the hold, dropped when gRPC is done with it.
        slices.emplace_back(const_cast<char*>(bytes), n, &ReleaseHold,
                            new std::shared_ptr<const void>(e.piece.data.owner()));
      });
      fields = e.tail;
    }
    slices.emplace_back(fields);
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
  // These under mu_: the next message's pieces, applied; an applied piece
  // that did not fit in it; whether the stream ended, and how.
  std::vector<Encoded> next_;
  std::optional<Encoded> carry_;
  bool ended_ = false;
  absl::Status error_;
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
