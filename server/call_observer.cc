#include "server/call_observer.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "rpc/grpc_edge.h"
#include "server/log.h"
#include "server/metrics.h"

namespace shardopt {
namespace {

class CallObserver final : public grpc::experimental::Interceptor {
 public:
  explicit CallObserver(std::string method) : method_(std::move(method)) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status st = methods->GetSendStatus();
      if (!st.ok()) {
        const std::string code = std::string(absl::StatusCodeToString(
            static_cast<absl::StatusCode>(st.error_code())));
        metrics::Registry::Default().Increment("shardopt_refusals_total", {{"method", method_}, {"code", code}});
        log::Fields fields = {{"method", method_}, {"code", code}, {"message", st.error_message()}};
        if (log::Allow(absl::StrCat(method_, "/", code), &fields)) log::Warning("refused", fields);
      }
    }
    methods->Proceed();
  }

 private:
  const std::string method_;  // the RPC's name, without the service
};

class Factory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(grpc::experimental::ServerRpcInfo* info) override {
    const std::string full = info->method() == nullptr ? "" : info->method();
    return new CallObserver(full.substr(full.rfind('/') + 1));
  }
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeCallObserverFactory() {
  return std::make_unique<Factory>();
}

}  // namespace shardopt
