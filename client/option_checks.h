// What the client refuses of its caller's options before any server is
// asked: what the servers would refuse too, or what no server could make
// sense of (a server listed twice, an enum value that names nothing).
#pragma once

#include <cstdint>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "shardopt/client.h"

namespace shardopt {

// A plain target (no scheme: gRPC then resolves it by DNS) names its port:
// gRPC would otherwise take 443, which no shardopt server listens on by
// default, and every call would fail as UNAVAILABLE as if the server were
// down. A target with a scheme (dns:, ipv4:, unix:, ...) is gRPC's to read.
absl::Status CheckServerAddress(const std::string& address);
// Connect's: each server listed once, each a CheckServerAddress, and
// CheckTlsPem.
absl::Status CheckClientOptions(const ClientOptions& options);
// TLS files as given (empty: not given): a client certificate and its key
// together or neither, each one PEM text that OpenSSL reads (a certificate
// in the CA file and the client's, an unencrypted key), and the key that of
// the client certificate. Otherwise INVALID_ARGUMENT here, where gRPC would
// fail every call as UNAVAILABLE, as if the server were down.
absl::Status CheckTlsPem(absl::string_view root_certs, absl::string_view cert_chain, absl::string_view private_key);
// A bearer token as a file or the environment gives it: without the
// surrounding whitespace (a file's trailing newline, which a Secret mounted
// as an environment variable keeps). Any other byte outside printable ASCII,
// the space included, is INVALID_ARGUMENT, naming its position and what it
// is, never the token: gRPC aborts the process on a header value it cannot
// send, and prints the header. Whitespace alone is INVALID_ARGUMENT too; ""
// is no token.
absl::StatusOr<std::string> CleanBearerToken(absl::string_view given);
// A name (`what`: "job name", "JOB", ...) that is not UTF-8 is
// INVALID_ARGUMENT, naming it escaped: protobuf would send it, logging an
// error on the caller's stderr, and the server refuse the whole message.
absl::Status CheckNameIsUtf8(absl::string_view what, absl::string_view name);
// CreateOrAttach's: a name, job, group and tensor names in UTF-8, tensors
// of numel in [1, 2^40] (rpc/job_limits.h, as the servers check it, before
// the placement's arithmetic), a world_size of at least 1 that holds
// `rank`, enum values that name something.
absl::Status CheckJobOptions(const JobOptions& job, uint32_t rank);
// Step's, before its push: refused after it, by the servers at the commit,
// the step could never go through (and a negative loss scale would move the
// params the wrong way).
// `ranks`: what the gradients are averaged over (world_size, times G in a
// node group).
absl::Status CheckStepOptions(const StepOptions& options, uint64_t ranks);
// The job's lrs as CheckLearningRates (rpc/learning_rates.h) checks them
// against its groups, before a push: the servers refuse them at the commit.
absl::Status CheckJobLearningRates(const JobOptions& job, double lr, absl::Span<const double> group_lr);

}  // namespace shardopt
