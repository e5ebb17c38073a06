#include "server/state_reactor.h"

#include <utility>

#include "rpc/grpc_edge.h"
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
  void WriteNext() {
    auto more = stream_->Next(&chunk_);
    if (!more.ok() || !*more) {
      Finish(more.ok() ? grpc::Status::OK : ToGrpcStatus(more.status()));
      return;
    }
    static metrics::Counter* const sent =
        metrics::Registry::Default().Series("shardopt_sent_bytes_total", {{"method", "read"}});
    sent->Add(static_cast<double>(chunk_.ByteSizeLong()));
    StartWrite(&chunk_);
  }

  std::unique_ptr<StreamLimits::Slot> slot_;
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
