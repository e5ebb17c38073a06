// Sees every call's final status on its way out, whatever the RPC and
// whichever API serves it (sync or callback), health checks aside: a
// refusal is counted in shardopt_refusals_total{method, code} (method
// "unknown" for one the server does not serve, including one of a service
// whose descriptor is linked in but not served, such as reflection's
// without --reflection) and logged at warning level
// with its code, message (which names the job) and peer, rate-limited per
// method and code so that a client cannot flood the log. A unary request gRPC could not
// parse, which gRPC answers INTERNAL with no message, is answered
// INVALID_ARGUMENT naming the request instead, or with the caller's
// authentication's refusal (UNAUTHENTICATED) where it has one: gRPC parses
// the request before the service's handler, which authenticates, runs.
//
// It also counts the calls in progress, for a shutdown that waits for them.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "grpcpp/support/server_interceptor.h"

namespace shardopt {

// `in_progress` counts the calls it sees (health checks aside) that gRPC
// has handed to the server and not yet finished. `services` are the full
// names of the services the server serves: a method of any other is
// "unknown". `authenticate` is the service's check of who calls (OK
// without tokens).
using Authenticate = std::function<absl::Status(const grpc::ServerContextBase&)>;
std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeCallObserverFactory(
    std::shared_ptr<std::atomic<int64_t>> in_progress, std::vector<std::string> services, Authenticate authenticate);

}  // namespace shardopt
