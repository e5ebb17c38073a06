#include "server/init_reactor.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "rpc/grpc_edge.h"

namespace shardopt {
namespace {

class InitReactor final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  InitReactor(JobStore* store, grpc::ByteBuffer* response) : store_(store), response_(response) {
    StartRead(&message_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the client closed its side
      v1::InitResponse answer;
      answer.set_elements(elements_);
      *response_ = SerializeMessage(answer);
      Finish(grpc::Status::OK);
      return;
    }
    if (absl::Status parsed = ParseMessage(&message_, &chunk_, "InitChunk"); !parsed.ok()) {
      Finish(ToGrpcStatus(absl::Status(parsed.code(), absl::StrCat(parsed.message(), " after ", elements_,
                                                                   " elements were written"))));
      return;
    }
    // A chunk without a job name continues the stream's job.
    if (chunk_.job().empty()) chunk_.set_job(job_);
    job_ = chunk_.job();
    auto written = store_->Init(chunk_);
    if (!written.ok()) {
      Finish(ToGrpcStatus(written.status()));
      return;
    }
    elements_ += *written;
    StartRead(&message_);
  }

  void OnDone() override { delete this; }

 private:
  JobStore* const store_;
  grpc::ByteBuffer* const response_;
  grpc::ByteBuffer message_;
  v1::InitChunk chunk_;
  std::string job_;
  uint64_t elements_ = 0;
};

}  // namespace

grpc::ServerReadReactor<grpc::ByteBuffer>* StartInitReactor(JobStore* store, grpc::ByteBuffer* response) {
  return new InitReactor(store, response);
}

}  // namespace shardopt
