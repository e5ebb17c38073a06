#include "server/state_reactor.h"

#include <utility>

#include "rpc/grpc_edge.h"
#include "server/grpc_hop.h"
#include "server/metrics.h"

namespace shardopt {
namespace {

class StateReactor final : public grpc::ServerWriteReactor<v1::StateChunk> {
 public:
  StateReactor(JobStore* store, const v1::ReadRequest* request, const Caller& caller,
               std::unique_ptr<StreamLimits::Slot> slot)
      : slot_(std::move(slot)) {
    if (absl::Status allowed = caller.Allows(Action::kRead, request->job()); !allowed.ok()) {
      Finish(ToGrpcStatus(allowed));
      return;
    }
    auto stream = store->OpenRead(*request);
    if (!stream.ok()) {
      Finish(ToGrpcStatus(stream.status()));
      return;
    }
    stream_ = *std::move(stream);
    WriteNext();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the caller stopped reading"));
      return;
    }
    WriteNext();
  }

  void OnDone() override { delete this; }

 private:
  // Called with no write in flight. While the job is half way through
  // applying a step, the read waits without a thread: the job's next change
  // calls this again, on one of gRPC's threads (grpc_hop.h).
  void WriteNext() {
    auto pulled = stream_->Next(&chunk_, [this] { hops_.Soon([this] { WriteNext(); }); });
    if (pulled.ok() && *pulled == JobStore::StateStream::Pulled::kLater) return;
    if (!pulled.ok() || *pulled == JobStore::StateStream::Pulled::kEnd) {
      Finish(pulled.ok() ? grpc::Status::OK : ToGrpcStatus(pulled.status()));
      return;
    }
    static metrics::Counter* const sent =
        metrics::Registry::Default().Series("shardopt_sent_bytes_total", {{"method", "read"}});
    sent->Add(static_cast<double>(chunk_.ByteSizeLong()));
    StartWrite(&chunk_);
  }

  std::unique_ptr<StreamLimits::Slot> slot_;
  GrpcHops hops_;
  std::unique_ptr<JobStore::StateStream> stream_;
  v1::StateChunk chunk_;
};

}  // namespace

grpc::ServerWriteReactor<v1::StateChunk>* StartStateReactor(JobStore* store, const v1::ReadRequest* request,
                                                            const Caller& caller,
                                                            std::unique_ptr<StreamLimits::Slot> slot) {
  return new StateReactor(store, request, caller, std::move(slot));
}

}  // namespace shardopt
