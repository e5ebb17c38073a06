// shardopt-server: one optimizer server process.
#include <semaphore.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "google/protobuf/descriptor.h"
#include "grpcpp/grpcpp.h"
#include "base/whole_file.h"
#include "checkpoint/directory_id.h"
#include "kernels/gpu.h"
#include "grpcpp/health_check_service_interface.h"
#include "rpc/tls_files.h"
#include "server/auth.h"
#include "server/device.h"
#include "server/log.h"
#include "server/memory_budget.h"
#include "server/metrics.h"
#include "server/metrics_http.h"
#include "server/open_files.h"
#include "server/job_spec.h"
#include "server/library_logs.h"
#include "server/listen_host.h"
#include "server/service.h"
#include "server/store_gauges.h"
#include "server/tls_copies.h"
#include "server/watched_files.h"
#include "shardopt/v1/optimizer.pb.h"
#include "rpc/grpc_edge.h"
#include "tools/flags.h"

ABSL_FLAG(std::string, host, "0.0.0.0",
          "address to listen on: IPv4, IPv6 (::1 or [::1]) or a name; also --metrics_port's and --health_port's");
ABSL_FLAG(int, port, 50051, "port to listen on; 0 picks an ephemeral port");
ABSL_FLAG(std::string, port_file, "", "if set, the chosen port is written here once listening");
ABSL_FLAG(std::string, device, "auto", "auto | cpu | cuda | cuda:N; auto picks CUDA when a GPU is usable");
ABSL_FLAG(bool, auto_requires_gpu, false,
          "with --device=auto, exit 1 when no GPU is usable instead of running on the CPU (the GPU image sets it)");
ABSL_FLAG(int, threads, 0, "CPU backend threads; 0: one per core");
ABSL_FLAG(int, max_message_bytes, shardopt::kDefaultMaxMessageBytes,
          absl::StrCat("largest gRPC message taken or sent, at least ", shardopt::JobStore::kMinMessageBytes));
ABSL_FLAG(int, barrier_timeout_ms, 60000, "default barrier deadline for jobs that give none");
ABSL_FLAG(uint64_t, staging_window_bytes, uint64_t{64} << 20,
          "per job, the most bytes of gradient chunks held while they wait for earlier ranks (at most 4 MiB per rank, at "
          "least about 128 KiB: a smaller figure is raised to that)");
ABSL_FLAG(std::string, checkpoint_dir, "",
          "checkpoints go here and jobs are restored from here; share it between a job's servers");
ABSL_FLAG(uint32_t, max_tensors_per_job, 16384, "CreateJob of more tensors (or groups) is RESOURCE_EXHAUSTED");
ABSL_FLAG(uint32_t, max_world_size, shardopt::kMaxWorldSize,
          "CreateJob of a larger world_size is RESOURCE_EXHAUSTED (at most 65536)");
ABSL_FLAG(uint32_t, max_name_bytes, shardopt::kMaxNameBytes,
          "CreateJob with a longer job, group or tensor name is INVALID_ARGUMENT (at most 200)");
ABSL_FLAG(int, idle_stream_timeout_ms, 120000,
          "a Push or Init stream the server waits on this long for its next message is cancelled (DEADLINE_EXCEEDED), "
          "and a Commit or Read whose caller reads nothing this long (CANCELLED)");
ABSL_FLAG(uint32_t, keepalive_seconds, 60,
          "ping each client connection this often, an idle one too, and close it when a ping goes unanswered for 10 s "
          "(a trainer whose machine died leaves no connection open); at most 86400, 0: no pings");
ABSL_FLAG(std::string, tokens_file, "",
          "bearer tokens, one per line: NAME trainer|admin TOKEN [JOB_PREFIX ...] [max_memory=BYTES]; every call "
          "then needs one (docs/design.md, security). Reloaded on SIGHUP and when the file changes");
ABSL_FLAG(std::string, memory_limit, "auto",
          "host memory the server's jobs and streams may hold, e.g. 20Gi or 512M; auto: the smaller of physical "
          "memory and the cgroup limit, less an eighth (at least 256 MiB) of headroom. Over it: RESOURCE_EXHAUSTED");
ABSL_FLAG(int, health_port, 0,
          "also serve grpc.health.v1 alone, in plaintext, on this port (for probes that cannot speak TLS); 0: none");
ABSL_FLAG(int, metrics_port, 0, "serve Prometheus metrics at http://HOST:PORT/metrics on this port; 0: none");
ABSL_FLAG(std::string, log_format, "text", "text (timestamp level event key=value ...) or json (one object per line)");
ABSL_FLAG(uint32_t, max_streams, 4096,
          "Push, Init, Commit and Read streams open at once; more are RESOURCE_EXHAUSTED; 0: no limit");
ABSL_FLAG(uint32_t, max_streams_per_client, 1024,
          "streams open at once per client (its token's name, or its address without --tokens_file); 0: no limit");
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain of this server; with --tls_key, serve TLS only");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(uint32_t, tls_reload_seconds, 60,
          "read --tls_cert, --tls_key and --tls_client_ca again this often, for new connections (a renewed "
          "certificate, a rotated Kubernetes Secret); 0: only at start");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA certificates; with it every client must present a certificate they signed (mutual TLS)");
ABSL_FLAG(bool, insecure, false,
          "allow plaintext on an address other than loopback (anyone who reaches the port can use every job)");
ABSL_FLAG(bool, reflection, false, "serve gRPC server reflection (it lists the services to anyone who asks)");
ABSL_FLAG(int, drain_failure_wait_seconds, 20,
          "after a SIGTERM drain in which a checkpoint failed, keep answering --metrics_port until one scrape, at "
          "most this long, so that Prometheus sees shardopt_checkpoint_failures_total move before the server "
          "exits; 0 to 3600, 0: exit at once");
ABSL_FLAG(uint64_t, checkpoint_keep, 0,
          "after a checkpoint completes, keep this many complete checkpoints per job and remove older steps; "
          "0 keeps all. The newest complete one is never removed");

namespace {
sem_t g_wake;
volatile std::sig_atomic_t g_stop = 0;
volatile std::sig_atomic_t g_reload = 0;
void OnStop(int) {
  g_stop = 1;
  sem_post(&g_wake);  // async-signal-safe
}
void OnReload(int) {
  g_reload = 1;
  sem_post(&g_wake);
}

// A --checkpoint_dir the server cannot write fails the start (exit 1): found
// only at the drain, it would cost every job its checkpoint, and the pod
// its state.
absl::Status CheckWritable(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  // Not made (a read-only volume): that, not the probe's ENOENT, is why.
  if (ec && !std::filesystem::is_directory(dir)) {
    return absl::FailedPreconditionError(
        absl::StrCat("--checkpoint_dir=", dir, " is not a writable directory: cannot create it: ", ec.message()));
  }
  // A name of its own: the servers sharing the directory start at once, and
  // in their pods each is pid 1.
  const std::string probe = shardopt::TemporaryName(dir + "/.shardopt-write-probe");
  const absl::Status written = shardopt::WriteFileNew(probe, {"probe"});
  std::filesystem::remove(probe, ec);
  // With the system's reason (a full disk, a read-only volume, permissions):
  // the operator's fix depends on it.
  return written.ok() ? absl::OkStatus()
                      : absl::FailedPreconditionError(absl::StrCat("--checkpoint_dir=", dir,
                                                                   " is not a writable directory: ", written.message()));
}

// Every flag whose value is not its default, whether the command line or a
// --flagfile set it (a pod's come from a ConfigMap), as --name=value,
// sorted: what the server runs with beyond its defaults.
// Whether a flag is not at its default: given, by the command line or a
// --flagfile.
bool Given(const absl::CommandLineFlag& flag) { return flag.CurrentValue() != flag.DefaultValue(); }

std::string FlagsSet() {
  std::vector<std::string> set;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (!flag->IsRetired() && Given(*flag)) {
      set.push_back(absl::StrCat("--", name, "=", flag->CurrentValue()));
    }
  }
  std::sort(set.begin(), set.end());
  return absl::StrJoin(set, " ");
}

// A start that fails says why, then ends with `exit` as every run does, so
// that an alert on exit lines sees a crash-looping pod too. Exit code 1.
int StartFailed(const std::string& error) {
  shardopt::log::Error("start_failed", {{"error", error}});
  shardopt::log::Error("exit", {{"code", "1"}, {"why", absl::StrCat("the start failed: ", error)}});
  return 1;
}
}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args = shardopt::ParseFlags(
      argc, argv,
      "one shardopt optimizer server: keeps the fp32 state of its shards of each job and runs AdamW on it.\n"
      "usage: shardopt-server [--host=ADDRESS] [--port=N] [--device=auto|cpu|cuda|cuda:N] [--checkpoint_dir=DIR]");
  if (!args.empty()) {
    shardopt::UsageError(absl::StrCat("takes no arguments, only flags; got '", absl::StrJoin(args, " "), "'"));
  }
  if (const int port = absl::GetFlag(FLAGS_port); port < 0 || port > 65535) {
    shardopt::UsageError(absl::StrCat("--port=", port, " is not a port (0 to 65535; 0 picks one)"));
  }
  for (const auto& [flag, port] : {std::pair{"health_port", absl::GetFlag(FLAGS_health_port)},
                                   std::pair{"metrics_port", absl::GetFlag(FLAGS_metrics_port)}}) {
    if (port < 0 || port > 65535) {
      shardopt::UsageError(absl::StrCat("--", flag, "=", port, " is not a port (1 to 65535; 0: none)"));
    }
  }
  // One port for two of the server's listeners: the second failed "address
  // already in use" (exit 1), as if another process held it.
  {
    const std::pair<const char*, int> ports[] = {{"port", absl::GetFlag(FLAGS_port)},
                                                 {"health_port", absl::GetFlag(FLAGS_health_port)},
                                                 {"metrics_port", absl::GetFlag(FLAGS_metrics_port)}};
    for (size_t i = 0; i < 3; ++i) {
      for (size_t j = i + 1; j < 3; ++j) {
        if (ports[i].second != 0 && ports[i].second == ports[j].second) {
          shardopt::UsageError(absl::StrCat("--", ports[i].first, " and --", ports[j].first, " are both ",
                                            ports[i].second, ": each listener needs a port of its own"));
        }
      }
    }
  }
  if (const int wait = absl::GetFlag(FLAGS_drain_failure_wait_seconds); wait < 0 || wait > 3600) {
    shardopt::UsageError(absl::StrCat("--drain_failure_wait_seconds=", wait, " must be 0 to 3600"));
  }
  if (const int threads = absl::GetFlag(FLAGS_threads); threads < 0 || threads > 4096) {
    shardopt::UsageError(absl::StrCat("--threads=", threads, " must be 0 (one per core) to 4096"));
  }
  if (const int64_t max = absl::GetFlag(FLAGS_max_message_bytes);
      max < static_cast<int64_t>(shardopt::JobStore::kMinMessageBytes)) {
    shardopt::UsageError(absl::StrCat("--max_message_bytes=", max, " is below ", shardopt::JobStore::kMinMessageBytes,
                                      ": a commit streams params in pieces of at least ",
                                      shardopt::JobStore::kMinMessageBytes / 2, " bytes"));
  }
  if (absl::GetFlag(FLAGS_barrier_timeout_ms) <= 0) shardopt::UsageError("--barrier_timeout_ms must be positive");
  if (absl::GetFlag(FLAGS_idle_stream_timeout_ms) <= 0) shardopt::UsageError("--idle_stream_timeout_ms must be positive");
  if (absl::GetFlag(FLAGS_keepalive_seconds) > 86400) shardopt::UsageError("--keepalive_seconds must be 0 to 86400");
  if (absl::GetFlag(FLAGS_max_name_bytes) < 1 || absl::GetFlag(FLAGS_max_name_bytes) > shardopt::kMaxNameBytes) {
    shardopt::UsageError(absl::StrCat("--max_name_bytes must be in [1, ", shardopt::kMaxNameBytes, "]"));
  }
  if (absl::GetFlag(FLAGS_max_tensors_per_job) < 1) shardopt::UsageError("--max_tensors_per_job must be at least 1");
  if (absl::GetFlag(FLAGS_max_world_size) < 1 || absl::GetFlag(FLAGS_max_world_size) > shardopt::kMaxWorldSize) {
    shardopt::UsageError(absl::StrCat("--max_world_size must be in [1, ", shardopt::kMaxWorldSize, "]"));
  }
  if (absl::GetFlag(FLAGS_tls_cert).empty() != absl::GetFlag(FLAGS_tls_key).empty()) {
    shardopt::UsageError("--tls_cert and --tls_key go together");
  }
  if (absl::GetFlag(FLAGS_tls_cert).empty() && !absl::GetFlag(FLAGS_tls_client_ca).empty()) {
    shardopt::UsageError("--tls_client_ca (mutual TLS) needs --tls_cert and --tls_key");
  }
  if (const absl::Status host = shardopt::CheckHostHasNoPort(absl::GetFlag(FLAGS_host)); !host.ok()) {
    shardopt::UsageError(std::string(host.message()));
  }
  if (absl::GetFlag(FLAGS_tls_cert).empty() && !shardopt::IsLoopback(absl::GetFlag(FLAGS_host)) &&
      !absl::GetFlag(FLAGS_insecure)) {
    shardopt::UsageError(absl::StrCat("plaintext on --host=", absl::GetFlag(FLAGS_host),
                                      " lets anyone who reaches the port read, change or drop every job: give "
                                      "--tls_cert and --tls_key, listen on loopback, or pass --insecure"));
  }
  std::string memory_limit_source;
  const auto memory_limit = shardopt::MemoryBudget::ParseLimit(absl::GetFlag(FLAGS_memory_limit), &memory_limit_source);
  if (!memory_limit.ok()) shardopt::UsageError(absl::StrCat("--memory_limit: ", memory_limit.status().message()));
  shardopt::TuneAllocatorForStreaming();
  // Debian's Abseil is built with deadlock detection on: a lock-order graph
  // updated on every absl::Mutex acquisition, which a pushed chunk takes
  // several of. The tests keep it; the server does without.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  if (absl::GetFlag(FLAGS_log_format) != "text" && absl::GetFlag(FLAGS_log_format) != "json") {
    shardopt::UsageError("--log_format must be text or json");
  }
  namespace log = shardopt::log;
  log::Init(absl::GetFlag(FLAGS_log_format) == "json" ? log::Format::kJson : log::Format::kText);
  shardopt::RouteLibraryLogs();

  auto backend = shardopt::MakeBackend(absl::GetFlag(FLAGS_device), absl::GetFlag(FLAGS_threads),
                                       absl::GetFlag(FLAGS_auto_requires_gpu));
  // A --device that does not parse is a usage error (exit 2), as every bad
  // flag is; a device that is not there is a failed start (exit 1).
  if (absl::IsInvalidArgument(backend.status())) shardopt::UsageError(std::string(backend.status().message()));
  if (!backend.ok()) {
    return StartFailed(std::string(backend.status().message()));
  }

  shardopt::JobStoreOptions store_options;
  store_options.default_barrier_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_barrier_timeout_ms));
  store_options.checkpoint_dir = absl::GetFlag(FLAGS_checkpoint_dir);
  store_options.checkpoint_keep = absl::GetFlag(FLAGS_checkpoint_keep);
  store_options.window_bytes = absl::GetFlag(FLAGS_staging_window_bytes);
  store_options.max_tensors_per_job = absl::GetFlag(FLAGS_max_tensors_per_job);
  store_options.max_world_size = absl::GetFlag(FLAGS_max_world_size);
  store_options.memory_limit = *memory_limit;
  store_options.max_name_bytes = absl::GetFlag(FLAGS_max_name_bytes);
  store_options.max_message_bytes = static_cast<uint64_t>(absl::GetFlag(FLAGS_max_message_bytes));
  if (!store_options.checkpoint_dir.empty()) {
    if (const absl::Status writable = CheckWritable(store_options.checkpoint_dir); !writable.ok()) {
      return StartFailed(std::string(writable.message()));
    }
    auto id = shardopt::checkpoint::DirectoryId(store_options.checkpoint_dir);
    if (!id.ok()) return StartFailed(std::string(id.status().message()));
    store_options.checkpoint_dir_id = *std::move(id);
    auto device = shardopt::checkpoint::DirectoryDevice(store_options.checkpoint_dir);
    if (!device.ok()) return StartFailed(std::string(device.status().message()));
    store_options.checkpoint_dir_device = *device;
  }
  const uint64_t max_open_files = shardopt::RaiseOpenFileLimit();  // before any connection (open_files.h)
  shardopt::JobStore store(backend->get(), store_options);
  std::unique_ptr<shardopt::Authenticator> auth;
  if (const std::string path = absl::GetFlag(FLAGS_tokens_file); !path.empty()) {
    auto loaded = shardopt::Authenticator::FromFile(path);
    if (!loaded.ok()) {
      return StartFailed(std::string(loaded.status().message()));
    }
    auth = *std::move(loaded);
  }
  shardopt::ServerOptions options;
  options.address = shardopt::HostPort(absl::GetFlag(FLAGS_host), absl::GetFlag(FLAGS_port));
  const shardopt::TlsFiles tls_paths{absl::GetFlag(FLAGS_tls_client_ca), absl::GetFlag(FLAGS_tls_cert),
                                     absl::GetFlag(FLAGS_tls_key)};
  std::unique_ptr<shardopt::TlsCopies> tls_copies;  // outlives the server, which reads them
  const std::string tls_identity = shardopt::TlsFilesIdentity(tls_paths);  // before they are read (TlsFilesWatch)
  {
    // Here, where gRPC would only fail to listen and say that of the port.
    absl::StatusOr<shardopt::TlsFiles> pem = shardopt::ReadTlsFiles(tls_paths);
    if (!pem.ok()) return StartFailed(std::string(pem.status().message()));
    // Only told: a clock that is off may be what is wrong, and the server
    // still serves clients that skip the check.
    if (absl::Status dates = shardopt::CheckCertificateDates(pem->cert, "--tls_cert"); !dates.ok()) {
      log::Warning("tls_certificate", {{"problem", std::string(dates.message())}});
    }
    if (!pem->cert.empty()) shardopt::ExportCertificateExpiry(pem->cert);
    options.tls_cert_pem = pem->cert;
    options.tls_key_pem = pem->key;
    options.tls_client_ca_pem = pem->client_ca;
    options.tls_reload_seconds = absl::GetFlag(FLAGS_tls_reload_seconds);
    if (!pem->cert.empty() && options.tls_reload_seconds > 0) {
      // gRPC reads checked copies, never the files themselves (server/tls_copies.h).
      absl::StatusOr<std::unique_ptr<shardopt::TlsCopies>> copies = shardopt::TlsCopies::Create(*pem);
      if (!copies.ok()) return StartFailed(std::string(copies.status().message()));
      tls_copies = *std::move(copies);
      options.tls_cert_file = tls_copies->paths().cert;
      options.tls_key_file = tls_copies->paths().key;
      options.tls_client_ca_file = tls_copies->paths().client_ca;
    }
  }
  options.reflection = absl::GetFlag(FLAGS_reflection);
  options.health_port = absl::GetFlag(FLAGS_health_port);
  options.keepalive_seconds = absl::GetFlag(FLAGS_keepalive_seconds);
  options.service.idle_stream_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_idle_stream_timeout_ms));
  options.service.auth = auth.get();
  options.service.max_streams = absl::GetFlag(FLAGS_max_streams);
  options.service.max_streams_per_client = absl::GetFlag(FLAGS_max_streams_per_client);
  // Before serving: a SIGTERM from the moment the port is open (or the port
  // file is there) must drain, not kill with the default action.
  sem_init(&g_wake, 0, 0);
  // A checkpoint past the process's file size limit (RLIMIT_FSIZE) must
  // fail with EFBIG and be answered INTERNAL, not kill the server.
  std::signal(SIGXFSZ, SIG_IGN);
  std::signal(SIGTERM, OnStop);
  std::signal(SIGINT, OnStop);
  std::signal(SIGHUP, OnReload);
  auto running = shardopt::StartServer(&store, options);
  if (!running.ok()) {
    return StartFailed(std::string(running.status().message()));
  }
  const std::string device = (*backend)->Describe();
  // The checkpoint counters from 0, so that an alert on their increase (no
  // checkpoint in two hours) sees a series on a server that has written none.
  for (const char* direction : {"write", "restore"}) {
    shardopt::metrics::Registry::Default().Increment("shardopt_checkpoint_bytes_total", {{"direction", direction}}, 0);
  }
  // Likewise the refusals the README's alerts watch, for every method: a
  // series that first appears at 1 shows no increase, so an alert on its
  // rate would miss the first refusal.
  const google::protobuf::ServiceDescriptor* optimizer =
      shardopt::v1::CreateJobRequest::descriptor()->file()->FindServiceByName("Optimizer");
  for (int i = 0; i < optimizer->method_count(); ++i) {
    for (const char* code : {"RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "UNAUTHENTICATED", "PERMISSION_DENIED"}) {
      shardopt::metrics::Registry::Default().Increment(
          "shardopt_refusals_total", {{"method", optimizer->method(i)->name()}, {"code", code}}, 0);
    }
  }
  shardopt::metrics::Registry::Default().SetGauge("process_start_time_seconds", {},
                                                  absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()));
  shardopt::metrics::Registry::Default().SetGauges([&store, &running, &backend, device, &auth] {
    return shardopt::StoreGauges(store, **backend, device, (*running)->service->open_streams(), auth.get());
  });
  std::unique_ptr<shardopt::MetricsServer> metrics_server;
  if (const int port = absl::GetFlag(FLAGS_metrics_port); port > 0) {
    auto started = shardopt::MetricsServer::Start(shardopt::BareHost(absl::GetFlag(FLAGS_host)), port,
                                                  &shardopt::metrics::Registry::Default());
    if (!started.ok()) {
      return StartFailed(std::string(started.status().message()));
    }
    metrics_server = *std::move(started);
  }
  // The port is written before "started" is logged (a file that cannot be
  // written fails the start) and renamed into place after it.
  const std::string port_file = absl::GetFlag(FLAGS_port_file), port_tmp = port_file + ".tmp";
  const auto port_file_failed = [&] {  // a harness waiting for the file would wait for good
    std::remove(port_tmp.c_str());
    (*running)->server->Shutdown(std::chrono::system_clock::now());
    return StartFailed(absl::StrCat("cannot write --port_file=", port_file));
  };
  std::error_code is_dir_error;  // a path the server may not look at is no directory: the write then fails
  if (!port_file.empty() && (std::filesystem::is_directory(port_file, is_dir_error) ||  // renamed after "started"
                             !(std::ofstream(port_tmp) << (*running)->port << "\n").flush())) {
    return port_file_failed();
  }
  log::Info("started", {{"version", shardopt::Version()},
                        {"address", shardopt::HostPort(absl::GetFlag(FLAGS_host), (*running)->port)},
                        {"transport", options.tls_cert_pem.empty()        ? "plaintext"
                                      : options.tls_client_ca_pem.empty() ? "tls"
                                                                          : "mutual-tls"},
                        {"device", device},
                        {"memory_limit_bytes", absl::StrCat(*memory_limit)},
                        {"memory_limit_source", memory_limit_source},
                        {"tokens", auth ? absl::StrCat(auth->size(), " from ", absl::GetFlag(FLAGS_tokens_file)) : "off"},
                        {"metrics_port", metrics_server ? absl::StrCat(metrics_server->port()) : "off"},
                        {"health_port", (*running)->health_port > 0 ? absl::StrCat((*running)->health_port) : "off"},
                        {"checkpoint_dir", store_options.checkpoint_dir},
                        {"checkpoint_dir_id", store_options.checkpoint_dir_id},
                        {"max_open_files", absl::StrCat(max_open_files)},
                        {"flags", FlagsSet()}});
  // Flags given that do nothing here: told, as an operator expects them
  // to act.
  if (store_options.checkpoint_keep > 0 && store_options.checkpoint_dir.empty()) {
    log::Warning("flag_ignored", {{"flag", "--checkpoint_keep"}, {"why", "no --checkpoint_dir: nothing to prune"}});
  }
  if (Given(absl::GetFlagReflectionHandle(FLAGS_tls_reload_seconds)) && options.tls_cert_pem.empty()) {
    log::Warning("flag_ignored", {{"flag", "--tls_reload_seconds"}, {"why", "no --tls_cert: no TLS files to reload"}});
  }
  if (Given(absl::GetFlagReflectionHandle(FLAGS_drain_failure_wait_seconds)) && metrics_server == nullptr) {
    log::Warning("flag_ignored", {{"flag", "--drain_failure_wait_seconds"}, {"why", "no --metrics_port: nothing to scrape"}});
  }
  if (!port_file.empty() && std::rename(port_tmp.c_str(), port_file.c_str()) != 0) return port_file_failed();

  // A sticky CUDA error makes the device useless until the process restarts:
  // report NOT_SERVING so that Kubernetes replaces the pod. Requests already
  // fail with UNAVAILABLE and the CUDA error's text.
  bool serving = true;
  // The tokens file is reloaded when it changes, too: Kubernetes updates a
  // mounted Secret in place (a new file behind the same path) and sends no
  // SIGHUP.
  const std::string tokens_path = absl::GetFlag(FLAGS_tokens_file);
  std::string tokens_seen = shardopt::FileIdentity(tokens_path);
  // The server checks each change of the TLS files as it did at start and
  // hands gRPC, which reads them again every --tls_reload_seconds, only the
  // usable ones.
  shardopt::TlsFilesWatch tls_watch(tls_paths, options.tls_reload_seconds, tls_copies.get(), tls_identity);
  for (;;) {
    timespec wake;
    clock_gettime(CLOCK_REALTIME, &wake);
    wake.tv_sec += 1;
    sem_timedwait(&g_wake, &wake);
    if (g_stop) break;
    if (auth != nullptr) {
      if (std::string now = shardopt::FileIdentity(tokens_path); now != tokens_seen) {
        tokens_seen = std::move(now);
        g_reload = 1;
      }
    }
    tls_watch.Poll();
    if (g_reload) {
      g_reload = 0;
      if (auth == nullptr) {
        log::Warning("tokens_reload", {{"result", "no --tokens_file to reload"}});
      } else if (const absl::Status st = auth->Reload(); !st.ok()) {
        log::Error("tokens_reload", {{"result", "kept the old tokens"}, {"error", std::string(st.message())}});
      } else {
        log::Info("tokens_reload", {{"tokens", absl::StrCat(auth->size())}});
      }
    }
    if (const absl::Status health = shardopt::CudaBackendHealth(**backend); serving && !health.ok()) {
      log::Error("device_failed", {{"health", "NOT_SERVING"}, {"error", std::string(health.message())}});
      (*running)->SetServing(false);
      serving = false;
    }
    if (serving && shardopt::AcceptFailedForDescriptors()) {
      log::Error("accept_failed", {{"health", "NOT_SERVING"},
                                   {"error", "accepting a connection failed: too many open files; gRPC accepts no "
                                             "new connection after that (grpc/grpc#20418): restart the server"}});
      (*running)->SetServing(false);
      serving = false;
    }
  }
  log::Info("stopping", {{"signal", "SIGTERM or SIGINT"}});
  // Not ready while it drains: probes and load balancers stop sending.
  (*running)->SetServing(false);
  // A Kubernetes preStop: finish the commits in flight, refuse new ones, write
  // each job's part at its step. With several servers the checkpoint becomes
  // complete only if every server of the job writes the same step (all of
  // them stopped between two steps); a job on one server is always complete.
  if (store_options.checkpoint_dir.empty()) {
    store.LogDiscardedAtStop();  // nothing to write them to: said, rather than let the jobs go unseen
  } else {
    int failed = 0;
    for (const auto& [job, result] : store.DrainAndCheckpoint()) {
      if (!result.ok()) ++failed;  // each logged by the store, as is each one written
    }
    if (failed > 0) {
      const uint64_t begun_before = metrics_server ? metrics_server->scrapes_begun() : 0;
      const int wait = absl::GetFlag(FLAGS_drain_failure_wait_seconds);
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(wait);
      (*running)->Stop(std::chrono::system_clock::now() + std::chrono::seconds(5));
      // The failure is in shardopt_checkpoint_failures_total, which no alert
      // sees unless a scrape reads it before the process is gone.
      if (metrics_server != nullptr && wait > 0) {
        const bool seen = metrics_server->WaitForScrapeAfter(begun_before, give_up);
        log::Warning("drain_failed_wait", {{"scraped", seen ? "true" : "false"}});
      }
      log::ReportSuppressed();
      log::Error("exit", {{"code", "1"},
                          {"why", absl::StrCat("the drain's checkpoints of ", failed, failed == 1 ? " job" : " jobs",
                                               " failed")}});
      return 1;
    }
  }
  (*running)->Stop(std::chrono::system_clock::now() + std::chrono::seconds(5));
  log::ReportSuppressed();
  log::Info("exit", {{"code", "0"}});
  return 0;
}
