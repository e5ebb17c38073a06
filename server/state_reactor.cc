#include "server/state_reactor.h"

#include <utility>

#include "rpc/grpc_edge.h"
#include "rpc/wire_format.h"
#include "server/grpc_hop.h"
#include "server/metrics.h"
#include "server/write_watch.h"

namespace shardopt {
namespace {

class StateReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  StateReactor(JobStore* store, grpc::CallbackServerContext* context, const grpc::ByteBuffer* request,
               const Caller& caller, std::unique_ptr<StreamLimits::Slot> slot, absl::Duration idle_timeout)
      : slot_(std::move(slot)), watch_(context, store->wakeups(), idle_timeout) {
    grpc::ByteBuffer copy = *request;  // shares the slices: ParseMessage reads it through
    v1::ReadRequest parsed;
    if (absl::Status st = ParseMessage(&copy, &parsed, "ReadRequest"); !st.ok()) {
      End(ToGrpcStatus(st));
      return;
    }
    if (absl::Status allowed = caller.Allows(Action::kRead, parsed.job()); !allowed.ok()) {
      End(ToGrpcStatus(allowed));
      return;
    }
    auto stream = store->OpenRead(parsed);
    if (!stream.ok()) {
      End(ToGrpcStatus(stream.status()));
      return;
    }
    stream_ = *std::move(stream);
    WriteNext();
  }

  void OnWriteDone(bool ok) override {
    watch_.Ended();
    if (!ok) {
      End(grpc::Status(grpc::StatusCode::CANCELLED, watch_.cut() ? "the caller read nothing for the idle timeout "
                                                                   "(--idle_stream_timeout_ms): the read is cancelled"
                                                                 : "the caller stopped reading"));
      return;
    }
    WriteNext();
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
  // Called with no write in flight. While the job is half way through
  // applying a step, the read waits without a thread: the job's next change
  // calls this again, on one of gRPC's threads (grpc_hop.h).
  void WriteNext() {
    grpc::Slice data;
    auto pulled = stream_->Next(
        &chunk_,
        [&data](size_t bytes) {
          data = grpc::Slice(bytes);  // uninitialized, and this reactor's alone until written
          return reinterpret_cast<char*>(const_cast<uint8_t*>(data.begin()));
        },
        [this] { hops_.Soon([this] { WriteNext(); }); });
    if (pulled.ok() && *pulled == JobStore::StateStream::Pulled::kLater) return;
    if (!pulled.ok() || *pulled == JobStore::StateStream::Pulled::kEnd) {
      End(pulled.ok() ? grpc::Status::OK : ToGrpcStatus(pulled.status()));
      return;
    }
    static metrics::Counter* const sent =
        metrics::Registry::Default().Series("shardopt_sent_bytes_total", {{"method", "read"}});
    // The fields but data, then data's tag and length, then its slice:
    // protobuf takes a message's fields in any order.
    std::string head = chunk_.SerializeAsString();
    wire::AppendBytesHeader(&head, v1::StateChunk::kDataFieldNumber, data.size());
    grpc::Slice slices[] = {grpc::Slice(head), std::move(data)};
    message_ = grpc::ByteBuffer(slices, 2);
    sent->Add(static_cast<double>(message_.Length()));
    watch_.Started();
    StartWrite(&message_);
  }

  std::unique_ptr<StreamLimits::Slot> slot_;
  WriteWatch watch_;
  GrpcHops hops_;
  std::unique_ptr<JobStore::StateStream> stream_;
  v1::StateChunk chunk_;     // the fields of the chunk being written but its data
  grpc::ByteBuffer message_;  // chunk_ as sent, alive until its write is done
};

}  // namespace

grpc::ServerWriteReactor<grpc::ByteBuffer>* StartStateReactor(JobStore* store, grpc::CallbackServerContext* context,
                                                              const grpc::ByteBuffer* request, const Caller& caller,
                                                              std::unique_ptr<StreamLimits::Slot> slot,
                                                              absl::Duration idle_timeout) {
  return new StateReactor(store, context, request, caller, std::move(slot), idle_timeout);
}

}  // namespace shardopt
