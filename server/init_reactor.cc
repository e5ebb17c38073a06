#include "server/init_reactor.h"

#include <memory>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "rpc/grpc_edge.h"

namespace shardopt {
namespace {

class InitReactor final : public ReadReactor {
 public:
  InitReactor(JobStore* store, grpc::CallbackServerContext* context, grpc::ByteBuffer* response, CallerCheck allows,
              StreamSettings settings)
      : ReadReactor("init", context, store->wakeups(), std::move(settings)), store_(store), response_(response),
        allows_(std::move(allows)) {}

 private:
  void OnMessage(grpc::ByteBuffer* message) override {
    if (absl::Status parsed = ParseMessage(message, &chunk_, "InitChunk"); !parsed.ok()) {
      return End(ToGrpcStatus(absl::Status(parsed.code(), absl::StrCat(parsed.message(), " after ", elements_,
                                                                       " elements were written"))));
    }
    // A chunk without a job name continues the stream's job; one naming
    // another is refused, as a push stream that changes job is. So is one of
    // another life of it: a chunk naming none is of the life the stream's
    // first chunk wrote, not of a job of the name made again meanwhile.
    if (chunk_.job().empty()) chunk_.set_job(job_);
    if (!job_.empty() && chunk_.job() != job_) {
      return End(Refused(absl::InvalidArgumentError(
          absl::StrCat("an Init stream is of one job: '", job_, "', then '", chunk_.job(), "'"))));
    }
    if (life_ != 0 && chunk_.incarnation() != 0 && chunk_.incarnation() != life_) {
      return End(Refused(absl::InvalidArgumentError(absl::StrCat("an Init stream is of one life of job '", job_,
                                                                 "': ", life_, ", then ", chunk_.incarnation()))));
    }
    job_ = chunk_.job();
    if (absl::Status allowed = allows_(Action::kInit, job_); !allowed.ok()) return End(Refused(allowed));
    Write();
  }

  // A refusal of a chunk says what went before it: each chunk is written
  // whole or not at all, and the ones before it stay written.
  grpc::Status Refused(const absl::Status& why) const {
    return ToGrpcStatus(absl::Status(why.code(), absl::StrCat(why.message(), "; the stream is refused after ",
                                                              elements_, " elements were written")));
  }

  // While a checkpoint streams the state, the chunk waits without a thread
  // (JobStore::TryInit) and is written when the store wakes the stream.
  void Write() {
    // Of the life the stream's first chunk found (also a first chunk that
    // waited: when woken it is not written into a job of its name made
    // again meanwhile).
    if (chunk_.incarnation() == 0) chunk_.set_incarnation(life_);
    auto written = store_->TryInit(
        chunk_, [weak = WeakSelf<InitReactor>()] { if (auto self = weak.lock()) self->Woken(); }, &life_);
    if (!written.ok()) return End(Refused(written.status()));
    if (!*written) return;
    elements_ += **written;
    Read();
  }

  void Woken() {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    if (!finished()) Write();
  }

  void OnClosed() override {
    v1::InitResponse answer;
    answer.set_elements(elements_);
    *response_ = SerializeMessage(answer);
    End(grpc::Status::OK);
  }

  std::string OnCut(bool) override {
    return absl::StrCat(elements_, " elements were written before; send the rest again");
  }

  JobStore* const store_;
  grpc::ByteBuffer* const response_;
  const CallerCheck allows_;
  v1::InitChunk chunk_;
  std::string job_;
  uint64_t life_ = 0;  // of job_, once a chunk found it
  uint64_t elements_ = 0;
};

}  // namespace

grpc::ServerReadReactor<grpc::ByteBuffer>* StartInitReactor(JobStore* store, grpc::CallbackServerContext* context,
                                                            grpc::ByteBuffer* response, CallerCheck allows,
                                                            StreamSettings settings) {
  return StartReadReactor<InitReactor>(store, context, response, std::move(allows), std::move(settings));
}

}  // namespace shardopt
