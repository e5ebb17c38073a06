#include "server/commit_reactor.h"

#include <memory>
#include <string>
#include <vector>

#include "grpcpp/server_context.h"
#include "grpcpp/support/slice.h"
#include "rpc/grpc_edge.h"
#include "rpc/wire_format.h"
#include "server/metrics.h"

namespace shardopt {
namespace {

class CommitReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  CommitReactor(JobStore* store, const grpc::ByteBuffer* request, const Caller& caller,
                std::unique_ptr<StreamLimits::Slot> slot)
      : slot_(std::move(slot)) {
    v1::CommitRequest parsed;
    grpc::ByteBuffer copy = *request;  // shares the slices: ParseMessage reads it through
    if (absl::Status st = ParseMessage(&copy, &parsed, "CommitRequest"); !st.ok()) {
      Finish(ToGrpcStatus(st));
      return;
    }
    if (absl::Status allowed = caller.Allows(Action::kCommit, parsed.job()); !allowed.ok()) {
      Finish(ToGrpcStatus(allowed));
      return;
    }
    auto stream = store->OpenCommit(parsed);
    if (!stream.ok()) {
      Finish(ToGrpcStatus(stream.status()));
      return;
    }
    stream_ = *std::move(stream);
    WriteNext();
  }

  void OnWriteDone(bool ok) override {
    if (!ok) {  // the caller went away: the step is still completed
      stream_->Abandon().IgnoreError();
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the caller stopped reading the params"));
      return;
    }
    WriteNext();
  }

  void OnDone() override { delete this; }

 private:
  // The params go out as slices over the memory they lie in, each keeping
  // the piece's hold until gRPC has sent it (ParamStream::Piece::data).
  void WriteNext() {
    auto piece = stream_->Next();
    if (!piece.ok() || !*piece) {
      Finish(piece.ok() ? grpc::Status::OK : ToGrpcStatus(piece.status()));
      return;
    }
    const ParamStream::Piece& p = **piece;
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
    StartWrite(&message_);
  }

  static void ReleaseHold(void* hold) { delete static_cast<std::shared_ptr<const void>*>(hold); }

  std::unique_ptr<StreamLimits::Slot> slot_;
  std::unique_ptr<ParamStream> stream_;
  grpc::ByteBuffer message_;
};

}  // namespace

grpc::ServerWriteReactor<grpc::ByteBuffer>* StartCommitReactor(JobStore* store, const grpc::ByteBuffer* request,
                                                               const Caller& caller,
                                                               std::unique_ptr<StreamLimits::Slot> slot) {
  return new CommitReactor(store, request, caller, std::move(slot));
}

}  // namespace shardopt
