#include "server/library_logs.h"

#include <atomic>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/stubs/logging.h"
#include "grpc/support/log.h"
#include "server/log.h"

namespace shardopt {
namespace {

// Set once gRPC says an accept failed for want of descriptors
// (AcceptFailedForDescriptors): its own log line is the only sign of it.
std::atomic<bool> accept_failed{false};

// gRPC's own log lines (a failed TLS handshake, a port it cannot bind) as
// the server's: with --log_format=json every line of stderr is then JSON.
// At most 5 a second from each line of gRPC's source, as refusals are: any
// peer can cause a failed handshake per connection, 13711 lines in 3 s.
void FromGrpc(gpr_log_func_args* args) {
  const absl::string_view message = args->message;
  // EMFILE and ENFILE ("... in system") alike; seen before the rate limit.
  if (absl::StartsWith(message, "Failed accept4") && absl::StrContains(message, "Too many open files")) {
    accept_failed.store(true);
  }
  const log::Level level = args->severity == GPR_LOG_SEVERITY_ERROR ? log::Level::kError
                           : args->severity == GPR_LOG_SEVERITY_DEBUG || args->severity == GPR_LOG_SEVERITY_INFO
                               ? log::Level::kInfo
                               : log::Level::kWarning;
  const std::string source = absl::StrCat(args->file, ":", args->line);
  log::Fields fields = {{"source", source}, {"message", args->message}};
  if (!log::Allow("grpc " + source, &fields)) return;
  log::Write(level, "grpc", fields);
}

// Protobuf's own log lines, the same way: any client can cause one per
// request (a string field that is not UTF-8).
void FromProtobuf(google::protobuf::LogLevel level, const char* file, int line, const std::string& message) {
  const std::string source = absl::StrCat(file, ":", line);
  log::Fields fields = {{"source", source}, {"message", message}};
  if (!log::Allow("protobuf " + source, &fields)) return;
  log::Write(level >= google::protobuf::LOGLEVEL_ERROR     ? log::Level::kError
             : level == google::protobuf::LOGLEVEL_WARNING ? log::Level::kWarning
                                                           : log::Level::kInfo,
             "protobuf", fields);
}

}  // namespace

bool AcceptFailedForDescriptors() { return accept_failed.load(); }

void RouteLibraryLogs() {
  gpr_set_log_function(FromGrpc);
  google::protobuf::SetLogHandler(FromProtobuf);
}

}  // namespace shardopt
