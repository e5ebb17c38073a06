#include "server/service.h"

#include <algorithm>
#include <functional>
#include <iterator>
#include <memory>
#include <optional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "grpc/grpc.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/ext/health_check_service_server_builder_option.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/impl/server_builder_option.h"
#include "grpcpp/impl/server_builder_plugin.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "base/status_macros.h"
#include "rpc/grpc_edge.h"
#include "rpc/wire_format.h"
#include "server/call_observer.h"
#include "server/listen_tcp.h"
#include "server/commit_reactor.h"
#include "server/metrics.h"
#include "server/init_reactor.h"
#include "server/push_reactor.h"
#include "server/state_reactor.h"

namespace shardopt {

namespace {

// A stream refused before it starts.
class RefusedRead final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  explicit RefusedRead(const absl::Status& status) { Finish(ToGrpcStatus(status)); }
  void OnDone() override { delete this; }
};
class RefusedWrite final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  explicit RefusedWrite(const absl::Status& status) { Finish(ToGrpcStatus(status)); }
  void OnDone() override { delete this; }
};

// "ipv4:127.0.0.1:5555" -> "ipv4:127.0.0.1": a client's connections share
// their address, not their port.
std::string PeerAddress(const std::string& peer) {
  const size_t colon = peer.rfind(':');
  return colon == std::string::npos ? peer : peer.substr(0, colon);
}

}  // namespace

absl::StatusOr<Caller> OptimizerService::Identify(const grpc::ServerContextBase& context) const {
  if (options_.auth == nullptr) return Caller{PeerAddress(context.peer()), Role::kAdmin, {}};
  const auto [it, end] = context.client_metadata().equal_range("authorization");
  // Which one to take would be a guess: a proxy that adds an entry would
  // choose who the caller is.
  if (it != end && std::next(it) != end) {
    return absl::UnauthenticatedError("the call has more than one 'authorization' metadata entry; send one");
  }
  return options_.auth->Authenticate(it == end ? absl::string_view()
                                               : absl::string_view(it->second.data(), it->second.size()));
}

absl::StatusOr<Caller> OptimizerService::Authorize(const grpc::ServerContextBase& context, Action action,
                                                   const std::string& job) const {
  SHARDOPT_ASSIGN_OR_RETURN(Caller caller, Identify(context));
  SHARDOPT_RETURN_IF_ERROR(caller.Allows(action, job));
  return caller;
}

CallerCheck OptimizerService::AsTokensAreNow(const grpc::ServerContextBase* context) const {
  // Called only from the reactor's OnMessage, which gRPC never runs after
  // the call's OnDone: the context is alive then, and the service outlives
  // every call. A stream's messages come many a second: each would compare
  // the token with every entry of the file, where only a reload (or another
  // job, which the streams refuse anyway) can change the answer.
  struct Checked {
    uint64_t generation;
    Action action;
    std::string job;
    absl::Status answer;
  };
  return [this, context, checked = std::optional<Checked>()](Action action, const std::string& job) mutable {
    const uint64_t generation = options_.auth == nullptr ? 0 : options_.auth->generation();
    if (!checked || checked->generation != generation || checked->action != action || checked->job != job) {
      // The generation is read first: a reload meanwhile is checked again.
      checked = Checked{generation, action, job, Authorize(*context, action, job).status()};
    }
    return checked->answer;
  };
}

absl::StatusOr<std::pair<Caller, std::unique_ptr<StreamLimits::Slot>>> OptimizerService::OpenStream(
    const grpc::ServerContextBase& context, Action action, const std::string& job) {
  SHARDOPT_ASSIGN_OR_RETURN(Caller caller, job.empty() ? Identify(context) : Authorize(context, action, job));
  SHARDOPT_ASSIGN_OR_RETURN(auto slot, streams_.Open(caller.name));
  return std::make_pair(std::move(caller), std::move(slot));
}

grpc::Status OptimizerService::CreateJob(grpc::ServerContext* context, const v1::CreateJobRequest* req,
                                         v1::CreateJobResponse* resp) {
  auto caller = Authorize(*context, Action::kCreate, req->job());
  if (!caller.ok()) return ToGrpcStatus(caller.status());
  // Charged to a token's name; without tokens the caller is named by its
  // address, a new one per connection, and nobody is charged.
  const JobOwner owner = options_.auth != nullptr ? JobOwner{caller->name, caller->max_memory} : JobOwner{};
  auto r = store_->CreateJob(*req, owner);
  if (!r.ok()) return ToGrpcStatus(r.status());
  *resp = *std::move(r);
  resp->set_max_message_bytes(store_->max_message_bytes());
  resp->set_takes_packed_grads(true);  // server/grad_message.h reads GradChunk.more
  return grpc::Status::OK;
}

grpc::ServerReadReactor<grpc::ByteBuffer>* OptimizerService::Init(grpc::CallbackServerContext* context,
                                                                  grpc::ByteBuffer* response) {
  auto opened = OpenStream(*context, Action::kInit, "");
  if (!opened.ok()) return new RefusedRead(opened.status());
  return StartInitReactor(store_, context, response, AsTokensAreNow(context),
                          {options_.idle_stream_timeout, std::move(opened->second), store_->budget()});
}

grpc::ServerReadReactor<grpc::ByteBuffer>* OptimizerService::Push(grpc::CallbackServerContext* context,
                                                                  grpc::ByteBuffer* response) {
  auto opened = OpenStream(*context, Action::kPush, "");
  if (!opened.ok()) return new RefusedRead(opened.status());
  return StartPushReactor(store_, context, response, AsTokensAreNow(context),
                          {options_.idle_stream_timeout, std::move(opened->second), store_->budget()});
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* OptimizerService::Commit(grpc::CallbackServerContext* context,
                                                                     const grpc::ByteBuffer* request) {
  auto opened = OpenStream(*context, Action::kCommit, "");
  if (!opened.ok()) return new RefusedWrite(opened.status());
  return StartCommitReactor(store_, context, request, opened->first, std::move(opened->second),
                            options_.idle_stream_timeout);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* OptimizerService::Read(grpc::CallbackServerContext* context,
                                                                   const grpc::ByteBuffer* request) {
  auto opened = OpenStream(*context, Action::kRead, "");
  if (!opened.ok()) return new RefusedWrite(opened.status());
  return StartStateReactor(store_, context, request, opened->first, std::move(opened->second),
                           options_.idle_stream_timeout);
}

grpc::Status OptimizerService::Describe(grpc::ServerContext* context, const v1::DescribeRequest* req,
                                        v1::DescribeResponse* resp) {
  if (auto caller = Authorize(*context, Action::kDescribe, req->job()); !caller.ok()) {
    return ToGrpcStatus(caller.status());
  }
  auto r = store_->Describe(*req);
  if (!r.ok()) return ToGrpcStatus(r.status());
  *resp = *std::move(r);
  return grpc::Status::OK;
}

grpc::Status OptimizerService::DropJob(grpc::ServerContext* context, const v1::DropJobRequest* req,
                                       v1::DropJobResponse*) {
  auto caller = Identify(*context);
  if (!caller.ok()) return ToGrpcStatus(caller.status());
  // A caller that may create the job may undo its own CreateJob of it (the
  // life it names), untouched since (DropJobRequest.undo).
  if (req->undo()) {
    if (absl::Status allowed = caller->Allows(Action::kCreate, req->job()); !allowed.ok()) {
      if (!absl::IsPermissionDenied(allowed)) return ToGrpcStatus(allowed);  // no job named
      return ToGrpcStatus(absl::PermissionDeniedError(
          absl::StrCat(allowed.message(), " (a DropJob with undo needs what a CreateJob of it needs)")));
    }
    return ToGrpcStatus(store_->UndoCreate(req->job(), req->incarnation()));
  }
  // A trainer may drop a job it made by mistake: the life it names of a job
  // of its prefixes that holds nothing yet (clients before
  // DropJobRequest.undo undid a fresh job so). Dropping state stays an
  // admin's.
  const bool empty_only = caller->role == Role::kTrainer && req->incarnation() != 0 &&
                          caller->Allows(Action::kCreate, req->job()).ok();
  if (!empty_only) {
    if (absl::Status allowed = caller->Allows(Action::kDrop, req->job()); !allowed.ok()) return ToGrpcStatus(allowed);
  }
  return ToGrpcStatus(store_->DropJob(req->job(), req->incarnation(), /*only_if_empty=*/empty_only));
}

grpc::Status OptimizerService::ListJobs(grpc::ServerContext* context, const v1::ListJobsRequest* req,
                                        v1::ListJobsResponse* resp) {
  auto caller = Identify(*context);
  if (!caller.ok()) return ToGrpcStatus(caller.status());
  // A trainer's token sees the jobs it may describe, and not that others
  // exist. (The store asks under its lock, so not through Allows, which
  // builds a refusal's message for every job it does not cover.)
  *resp = store_->ListJobs(*req, [&](const std::string& job) { return caller->Covers(job); });
  return grpc::Status::OK;
}

grpc::Status OptimizerService::Checkpoint(grpc::ServerContext* context, const v1::CheckpointRequest* req,
                                          v1::CheckpointResponse* resp) {
  if (auto caller = Authorize(*context, Action::kCheckpoint, req->job()); !caller.ok()) {
    return ToGrpcStatus(caller.status());
  }
  // A step half applied is waited for only as long as the caller waits:
  // its committer may never read on, and this holds a thread meanwhile.
  // The wait ends a tenth of the caller's time (at most 1 s) before its
  // deadline, so that the answer, which says what it waited for, reaches
  // the caller before its own gRPC gives up with a bare "Deadline Exceeded".
  const auto d = context->deadline();
  absl::Time until = absl::InfiniteFuture();
  if (d != std::chrono::system_clock::time_point::max()) {
    const absl::Time caller = absl::FromChrono(d);
    until = caller - std::clamp((caller - absl::Now()) / 10, absl::ZeroDuration(), absl::Seconds(1));
  }
  auto r = store_->Checkpoint(*req, until);
  if (!r.ok()) return ToGrpcStatus(r.status());
  *resp = *std::move(r);
  return grpc::Status::OK;
}

namespace {

// A server being stopped: no new call from its construction on, and its
// listening ports closed. Finish lets those in progress (while `busy`) end
// until `deadline`, then cancels the rest. gRPC's Shutdown(deadline) also
// waits, until the deadline, for every connection to close once told to go
// away, which a client with no call running reads only at its channel's
// next backup poll, up to 5 s later: an idle trainer held each SIGTERM that
// long. Once no call is in progress, that wait is all that is left, and
// cancelling ends it. The tenth of a second is for a call gRPC took before
// the shutdown and has not yet handed to the server (whose observer is not
// made yet).
class Stopping {
 public:
  explicit Stopping(grpc::Server* server)
      : server_(server),
        // gRPC core's own queue, as the C++ Shutdown uses one (unregistered
        // with the server, which core allows for this call): the C++ queue
        // takes only its own kinds of tag.
        cq_(grpc_completion_queue_create_for_next(nullptr)),
        grace_ends_(std::chrono::system_clock::now() + std::chrono::milliseconds(100)) {
    grpc_server_shutdown_and_notify(server_->c_server(), cq_, nullptr);
  }
  Stopping(const Stopping&) = delete;
  Stopping& operator=(const Stopping&) = delete;

  void Finish(std::chrono::system_clock::time_point deadline, const std::function<bool()>& busy) {
    for (bool cancelled = false;;) {
      const auto now = std::chrono::system_clock::now();
      gpr_timespec wait;
      grpc::Timepoint2Timespec(cancelled ? now + std::chrono::milliseconds(10)
                                         : std::min(deadline, now + std::chrono::milliseconds(10)),
                               &wait);
      if (grpc_completion_queue_next(cq_, wait, nullptr).type == GRPC_OP_COMPLETE) break;
      if (!cancelled && ((now >= grace_ends_ && !busy()) || now >= deadline)) {
        grpc_server_cancel_all_calls(server_->c_server());
        cancelled = true;
      }
    }
    grpc_completion_queue_shutdown(cq_);
    while (grpc_completion_queue_next(cq_, gpr_inf_future(GPR_CLOCK_REALTIME), nullptr).type != GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(cq_);
    server_->Shutdown(deadline);  // stopped already: the rest of the C++ server's own shutdown
  }

 private:
  grpc::Server* const server_;
  grpc_completion_queue* const cq_;
  const std::chrono::system_clock::time_point grace_ends_;
};

}  // namespace

void RunningServer::Stop(std::chrono::system_clock::time_point deadline) {
  // Both ports close at once: the health port used to be stopped after the
  // main port's calls had had their grace, so a probe got NOT_SERVING for
  // 5 s more from a server whose gRPC port had closed. Its calls (health
  // checks) need no finishing.
  std::optional<Stopping> health;
  if (health_server) health.emplace(health_server.get());
  Stopping service(server.get());
  if (health) health->Finish(deadline, [] { return false; });
  service.Finish(deadline, [this] { return calls_in_progress->load(std::memory_order_relaxed) > 0; });
}

RunningServer::~RunningServer() {
  if (health_server) health_server->Shutdown();
  if (server) server->Shutdown();
}

void RunningServer::SetServing(bool is_serving) {
  serving = is_serving;
  server->GetHealthCheckService()->SetServingStatus(is_serving);  // "" and shardopt.v1.Optimizer
}

namespace {

std::shared_ptr<grpc::ServerCredentials> Credentials(const ServerOptions& options) {
  if (options.tls_cert_pem.empty()) return grpc::InsecureServerCredentials();
  if (options.tls_reload_seconds > 0 && !options.tls_cert_file.empty()) {
    // gRPC's file watcher reads the files again every interval; the PEM
    // text above was checked at start, and main checks each change.
    auto files = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
        options.tls_key_file, options.tls_cert_file, options.tls_client_ca_file, options.tls_reload_seconds);
    grpc::experimental::TlsServerCredentialsOptions tls(files);
    tls.watch_identity_key_cert_pairs();
    if (!options.tls_client_ca_file.empty()) tls.watch_root_certs();
    tls.set_cert_request_type(options.tls_client_ca_file.empty()
                                  ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                  : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    return grpc::experimental::TlsServerCredentials(tls);
  }
  grpc::SslServerCredentialsOptions ssl(options.tls_client_ca_pem.empty()
                                            ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                            : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  ssl.pem_root_certs = options.tls_client_ca_pem;
  ssl.pem_key_cert_pairs.push_back({options.tls_key_pem, options.tls_cert_pem});
  return grpc::SslServerCredentials(ssl);
}

// Linking gRPC's reflection library registers its plugin with every
// ServerBuilder of the process; this option takes it out again unless the
// server was asked for reflection.
class WithoutReflection final : public grpc::ServerBuilderOption {
 public:
  void UpdateArguments(grpc::ChannelArguments*) override {}
  void UpdatePlugins(std::vector<std::unique_ptr<grpc::ServerBuilderPlugin>>* plugins) override {
    plugins->erase(std::remove_if(plugins->begin(), plugins->end(),
                                  [](const auto& p) { return p->name() == "proto_server_reflection"; }),
                   plugins->end());
  }
};

// The health port's one method, Check, answered as the main port's default
// health service answers it: for the server ("") and for its service
// (shardopt.v1.Optimizer), the server's own status (HealthCheckResponse{status:
// SERVING} is 08 01, NOT_SERVING 08 02); for another name, NOT_FOUND.
// Anything else is UNIMPLEMENTED.
class HealthOnly final : public grpc::CallbackGenericService {
 public:
  explicit HealthOnly(const std::atomic<bool>* serving) : serving_(serving) {}
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* context) override {
    return new Check(context->method() == "/grpc.health.v1.Health/Check", serving_);
  }

 private:
  class Check final : public grpc::ServerGenericBidiReactor {
   public:
    Check(bool known, const std::atomic<bool>* serving) : serving_(serving) {
      if (!known) {
        Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "this port serves grpc.health.v1.Health/Check only"));
        return;
      }
      StartRead(&request_);
    }
    void OnReadDone(bool) override {
      if (!KnownService(request_)) {
        Finish(grpc::Status(grpc::StatusCode::NOT_FOUND, "service name unknown"));
        return;
      }
      grpc::Slice slice(std::string(serving_->load() ? "\x08\x01" : "\x08\x02", 2));
      response_ = grpc::ByteBuffer(&slice, 1);
      StartWriteAndFinish(&response_, grpc::WriteOptions(), grpc::Status::OK);
    }
    void OnDone() override { delete this; }

   private:
    // HealthCheckRequest's one field, service (1, a string); empty or
    // absent names the server. A request that does not parse names no
    // service known.
    static bool KnownService(const grpc::ByteBuffer& request) {
      grpc::Slice whole;
      if (!request.DumpToSingleSlice(&whole).ok()) return request.Length() == 0;
      const Pieces message = Pieces::Own(std::string(reinterpret_cast<const char*>(whole.begin()), whole.size()));
      std::vector<wire::Field> fields;
      if (!wire::ScanFields(message, &fields)) return false;
      std::string name;  // the last one, as protobuf's parser takes it
      for (const wire::Field& f : fields) {
        if (f.number != 1 || f.wire_type != wire::kLengthDelimited) continue;
        name.resize(f.end - f.value);
        message.Sub(f.value, f.end - f.value).CopyTo(name.data());
      }
      return name.empty() || name == v1::Optimizer::service_full_name();
    }

    const std::atomic<bool>* const serving_;
    grpc::ByteBuffer request_, response_;
  };
  const std::atomic<bool>* const serving_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<RunningServer>> StartServer(JobStore* store, const ServerOptions& options) {
  if (options.tls_cert_pem.empty() != options.tls_key_pem.empty()) {
    return absl::InvalidArgumentError("TLS needs both a certificate and its private key");
  }
  if (options.tls_cert_pem.empty() && !options.tls_client_ca_pem.empty()) {
    return absl::InvalidArgumentError("a client CA (mutual TLS) needs the server's own certificate and key");
  }
  grpc::EnableDefaultHealthCheckService(true);
  if (options.reflection) grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  auto running = std::make_unique<RunningServer>();
  running->service = std::make_unique<OptimizerService>(store, options.service);
  grpc::ServerBuilder builder;
  if (!options.reflection) builder.SetOption(std::make_unique<WithoutReflection>());
  // gRPC's default SO_REUSEPORT lets a second server bind a port already in
  // use, and with port 0 two servers started at once can be handed the same
  // one (grpc/grpc#10755): clients then reach either. A port is one server's.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.AddListeningPort(options.address, Credentials(options), &running->port);
  TuneServerBuilder(&builder, static_cast<int>(store->max_message_bytes()));
  if (options.keepalive_seconds > 0) {
    // With nothing to send, a server never learns that a client's machine
    // died or its path went away: the connection stayed open for good, one
    // more for every trainer lost so. Idle connections are pinged too, and
    // pings go on while the client sends nothing (gRPC's default stops
    // after two). A gRPC client with no call open answers only at its
    // backup poll, every 5 s: at a 1 s timeout the server closed healthy
    // idle connections.
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS, static_cast<int>(options.keepalive_seconds) * 1000);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 10000);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
  }
  builder.RegisterService(running->service.get());
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> observers;
  // The services a refusal's method label may name (health checks are not
  // counted); gRPC 1.51's reflection plugin serves the v1alpha service only.
  std::vector<std::string> served = {v1::Optimizer::service_full_name()};
  if (options.reflection) served.push_back("grpc.reflection.v1alpha.ServerReflection");
  observers.push_back(MakeCallObserverFactory(
      running->calls_in_progress, std::move(served),
      [service = running->service.get()](const grpc::ServerContextBase& context) {
        return service->Identify(context).status();
      }));
  builder.experimental().SetInterceptorCreators(std::move(observers));
  running->server = builder.BuildAndStart();
  if (!running->server || running->port == 0) {
    const std::string why = WhyCannotListen(options.address);
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.address, why.empty() ? "" : ": ", why));
  }
  // The default health service knows "" only; a probe may name the service.
  running->server->GetHealthCheckService()->SetServingStatus(v1::Optimizer::service_full_name(), true);
  if (options.health_port > 0) {
    // Its own server, so that the plaintext port has no other service on it.
    const std::string host = options.address.substr(0, options.address.rfind(':'));
    grpc::ServerBuilder health;
    health.SetOption(std::make_unique<WithoutReflection>());
    // Not the default health service: it would need a polled completion
    // queue on a server with no other service.
    health.SetOption(std::make_unique<grpc::HealthCheckServiceServerBuilderOption>(nullptr));
    running->health_service = std::make_unique<HealthOnly>(&running->serving);
    health.RegisterCallbackGenericService(running->health_service.get());
    health.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    // It answers anyone, in plaintext: a check is a name, and nothing more
    // than a few KiB, nor anything compressed, is read.
    health.SetMaxReceiveMessageSize(4096);
    RefuseCompressedMessages(&health);
    health.AddListeningPort(absl::StrCat(host, ":", options.health_port), grpc::InsecureServerCredentials(),
                            &running->health_port);
    running->health_server = health.BuildAndStart();
    if (!running->health_server || running->health_port == 0) {
      const std::string why = WhyCannotListen(absl::StrCat(host, ":", options.health_port));
      return absl::UnavailableError(absl::StrCat("cannot listen on ", host, ":", options.health_port,
                                                 " (--health_port)", why.empty() ? "" : ": ", why));
    }
  }
  return running;
}

}  // namespace shardopt
