#include "server/call_observer.h"

#include <algorithm>
#include <atomic>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/server_context.h"
#include "rpc/grpc_edge.h"
#include "server/log.h"
#include "server/messages.h"
#include "server/metrics.h"

namespace shardopt {
namespace {

class CallObserver final : public grpc::experimental::Interceptor {
 public:
  // The peer is taken as soon as the context has it: a callback stream's
  // as the call begins (a cancelled call's context says "unknown" by the
  // time its status goes out), a synchronous call's, whose context is bound
  // to the call only after its interceptors are made, at a later hook.
  // `parsed_by_grpc`: gRPC's generated code parses the request (a unary RPC;
  // the service's streams parse their own: init_reactor.h).
  // `unserved`: the path of a call to a method the server does not serve
  // (then `method` is "unknown"), empty otherwise.
  CallObserver(std::string method, std::string unserved, bool parsed_by_grpc, grpc::ServerContextBase* context,
               std::shared_ptr<std::atomic<int64_t>> in_progress, const Authenticate* authenticate)
      : method_(std::move(method)), unserved_(std::move(unserved)), parsed_by_grpc_(parsed_by_grpc),
        context_(context), in_progress_(std::move(in_progress)), authenticate_(authenticate) {
    TakePeer();
    in_progress_->fetch_add(1, std::memory_order_relaxed);
  }
  // gRPC deletes a call's interceptors when the call is done.
  ~CallObserver() override { in_progress_->fetch_sub(1, std::memory_order_relaxed); }

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    TakePeer();
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      grpc::Status st = methods->GetSendStatus();
      if (st.error_code() == grpc::StatusCode::INTERNAL && st.error_message().empty() && parsed_by_grpc_) {
        // gRPC's own parse of a synchronous RPC's request failed (the
        // service's INTERNALs all say what broke): the caller's mistake,
        // once the caller is known. The handler, which authenticates, never
        // ran, and a caller without a token learns nothing of the request.
        const absl::Status who = (*authenticate_)(*context_);
        st = !who.ok() ? ToGrpcStatus(who)
                       : grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                      absl::StrCat("the ", method_, "Request message does not parse (malformed, or "
                                                   "a string field that is not UTF-8); nothing was done"));
        methods->ModifySendStatus(st);
      }
      if (!unserved_.empty() && st.error_code() == grpc::StatusCode::UNIMPLEMENTED && st.error_message().empty()) {
        // gRPC's answer says nothing; the log line's "unknown" method would
        // not tell an operator what the caller tried (an outside probe).
        st = grpc::Status(grpc::StatusCode::UNIMPLEMENTED,
                          absl::StrCat("this server serves no method ", Quote(unserved_)));
        methods->ModifySendStatus(st);
      }
      if (!st.ok()) {
        const std::string code = std::string(absl::StatusCodeToString(
            static_cast<absl::StatusCode>(st.error_code())));
        metrics::Registry::Default().Increment("shardopt_refusals_total", {{"method", method_}, {"code", code}});
        // The peer too: a refusal for a wrong token names no one else.
        log::Fields fields = {{"method", method_},
                              {"code", code},
                              {"message", st.error_message()},
                              {"peer", peer_}};
        if (log::Allow(absl::StrCat(method_, "/", code), &fields)) log::Warning("refused", fields);
      }
    }
    methods->Proceed();
  }

 private:
  void TakePeer() {
    if (peer_.empty() && context_ != nullptr) peer_ = context_->peer();
  }

  const std::string method_;  // the RPC's name, without the service
  const std::string unserved_;
  const bool parsed_by_grpc_;
  grpc::ServerContextBase* const context_;
  const std::shared_ptr<std::atomic<int64_t>> in_progress_;
  const Authenticate* const authenticate_;  // the factory's, which outlives the server's calls
  std::string peer_;
};

// The method a call's path names, or null for one the server does not
// serve: the caller chooses the path, and each name would be a metric series
// and a log rate limit of its own. The descriptor pool holds every service
// linked into the binary, served or not (reflection's, without
// --reflection), so the service is checked against those served.
const google::protobuf::MethodDescriptor* Method(const std::string& path, const std::vector<std::string>& services) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos || slash == 0) return nullptr;
  const std::string service = path.substr(1, slash - 1);
  if (std::find(services.begin(), services.end(), service) == services.end()) return nullptr;
  return google::protobuf::DescriptorPool::generated_pool()->FindMethodByName(
      absl::StrCat(service, ".", path.substr(slash + 1)));
}

class Factory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  Factory(std::shared_ptr<std::atomic<int64_t>> in_progress, std::vector<std::string> services,
          Authenticate authenticate)
      : in_progress_(std::move(in_progress)), services_(std::move(services)), authenticate_(std::move(authenticate)) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override {
    const std::string path = info->method() == nullptr ? "" : info->method();
    // Health checks are not refusals: a check of a service not served here
    // is NOT_FOUND, and a Watch ends when its client goes.
    if (absl::StartsWith(path, "/grpc.health.v1.Health/")) return nullptr;
    const google::protobuf::MethodDescriptor* method = Method(path, services_);
    return new CallObserver(method == nullptr ? "unknown" : method->name(), method == nullptr ? path : "",
                            method != nullptr && !method->client_streaming() && !method->server_streaming(),
                            info->server_context(), in_progress_, &authenticate_);
  }

 private:
  const std::shared_ptr<std::atomic<int64_t>> in_progress_;
  const std::vector<std::string> services_;
  const Authenticate authenticate_;
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeCallObserverFactory(
    std::shared_ptr<std::atomic<int64_t>> in_progress, std::vector<std::string> services, Authenticate authenticate) {
  return std::make_unique<Factory>(std::move(in_progress), std::move(services), std::move(authenticate));
}

}  // namespace shardopt
