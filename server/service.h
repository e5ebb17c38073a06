// The gRPC face of JobStore: decode, call the core, encode. No logic of its own.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>

#include "server/auth.h"
#include "server/job_store.h"
#include "server/stream_limits.h"
#include "shardopt/v1/optimizer.grpc.pb.h"

namespace grpc {
class CallbackGenericService;
class Server;
}

namespace shardopt {

// The streaming RPCs are served on gRPC's callback API, with raw messages
// (Push, Init, Commit and Read): a push that waits (for room in the running sum's
// window, or at the barrier) holds no thread, so any number of ranks can
// wait on a server with a fixed set of threads (push_reactor.h); a commit's
// params are copied once on their way out (commit_reactor.h); and a message
// of any stream that does not parse is INVALID_ARGUMENT (init_reactor.h).
// No stream holds a thread while it waits; the unary RPCs stay synchronous.
//
// Every RPC but health checks first authenticates its caller (auth.h) and
// checks that it may do this to the job; every stream holds one of the
// server's stream slots (stream_limits.h) while it is open.
struct ServiceOptions {
  // A stream the server waits on this long for its next message is cut.
  absl::Duration idle_stream_timeout = absl::Minutes(2);
  // Not owned; null: no tokens, every caller may do everything.
  const Authenticator* auth = nullptr;
  // Streams open at once on this server, and per client; 0: no cap.
  uint32_t max_streams = 4096;
  uint32_t max_streams_per_client = 1024;
};

class OptimizerService final
    : public v1::Optimizer::WithRawCallbackMethod_Read<v1::Optimizer::WithRawCallbackMethod_Init<
          v1::Optimizer::WithRawCallbackMethod_Push<v1::Optimizer::WithRawCallbackMethod_Commit<v1::Optimizer::Service>>>> {
 public:
  OptimizerService(JobStore* store, const ServiceOptions& options)
      : store_(store), options_(options), streams_(options.max_streams, options.max_streams_per_client) {}

  grpc::Status CreateJob(grpc::ServerContext*, const v1::CreateJobRequest*, v1::CreateJobResponse*) override;
  grpc::ServerReadReactor<grpc::ByteBuffer>* Init(grpc::CallbackServerContext*, grpc::ByteBuffer*) override;
  grpc::ServerReadReactor<grpc::ByteBuffer>* Push(grpc::CallbackServerContext*, grpc::ByteBuffer*) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Commit(grpc::CallbackServerContext*, const grpc::ByteBuffer*) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Read(grpc::CallbackServerContext*, const grpc::ByteBuffer*) override;
  grpc::Status Describe(grpc::ServerContext*, const v1::DescribeRequest*, v1::DescribeResponse*) override;
  grpc::Status DropJob(grpc::ServerContext*, const v1::DropJobRequest*, v1::DropJobResponse*) override;
  grpc::Status ListJobs(grpc::ServerContext*, const v1::ListJobsRequest*, v1::ListJobsResponse*) override;
  grpc::Status Checkpoint(grpc::ServerContext*, const v1::CheckpointRequest*, v1::CheckpointResponse*) override;

  // Streams open now, for tests and metrics.
  uint32_t open_streams() const { return streams_.open(); }

  // Who is calling: the token's holder, or with no tokens the peer's
  // address. Public for the call observer, which answers a request gRPC
  // could not parse before any handler of this service ran.
  absl::StatusOr<Caller> Identify(const grpc::ServerContextBase& context) const;

 private:
  // The caller, if it may do `action` to `job`.
  absl::StatusOr<Caller> Authorize(const grpc::ServerContextBase& context, Action action, const std::string& job) const;
  // Authorize for a stream's messages, with the tokens as they are at each.
  CallerCheck AsTokensAreNow(const grpc::ServerContextBase* context) const;
  // The caller and a stream slot for a stream; `job` empty when the job is
  // known only from the stream's messages (each is checked then).
  absl::StatusOr<std::pair<Caller, std::unique_ptr<StreamLimits::Slot>>> OpenStream(
      const grpc::ServerContextBase& context, Action action, const std::string& job);

  JobStore* store_;
  const ServiceOptions options_;
  StreamLimits streams_;
};

struct ServerOptions {
  std::string address = "0.0.0.0:0";  // port 0: an ephemeral port
  // TLS: the server's certificate chain and private key (PEM); both empty
  // for plaintext. With `tls_client_ca` (PEM) set too, every client must
  // present a certificate that it signed (mutual TLS).
  std::string tls_cert_pem;
  std::string tls_key_pem;
  std::string tls_client_ca_pem;
  // Files gRPC reads again every `tls_reload_seconds` (0: never), for new
  // connections; connections open stay as they are. gRPC takes them as they
  // are, so shardopt-server names its checked copies here (server/tls_copies.h).
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;
  unsigned tls_reload_seconds = 0;
  // gRPC server reflection, which lists the services to anyone who asks.
  bool reflection = false;
  // A second, plaintext port that serves only grpc.health.v1, for probes
  // that cannot speak TLS (Kubernetes' native gRPC probes); 0: none.
  int health_port = 0;
  // Pings each connection this often, an idle one too, and closes one whose
  // ping goes unanswered for 10 s; 0: none.
  unsigned keepalive_seconds = 0;
  ServiceOptions service;
};

// A running server: the gRPC server with health (and reflection if asked),
// over a store.
struct RunningServer {
  std::unique_ptr<OptimizerService> service;
  std::unique_ptr<grpc::Server> server;
  // With health_port only: grpc.health.v1.Health/Check, answered by hand
  // from `serving`, on a server of its own.
  std::atomic<bool> serving{true};
  std::unique_ptr<grpc::CallbackGenericService> health_service;
  std::unique_ptr<grpc::Server> health_server;
  int port = 0;
  int health_port = 0;
  // The calls of `server` in progress, health checks aside (the call observer's).
  std::shared_ptr<std::atomic<int64_t>> calls_in_progress = std::make_shared<std::atomic<int64_t>>(0);
  // What both servers' health services answer.
  void SetServing(bool serving);
  // Both servers take no new call, let those in progress end until
  // `deadline`, then cancel any left; returns once both have stopped.
  void Stop(std::chrono::system_clock::time_point deadline);
  ~RunningServer();
};

absl::StatusOr<std::unique_ptr<RunningServer>> StartServer(JobStore* store, const ServerOptions& options);

}  // namespace shardopt
