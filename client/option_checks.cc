#include "client/option_checks.h"


#include <cmath>
#include <memory>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "rpc/job_limits.h"
#include "rpc/tls_files.h"

namespace shardopt {

absl::Status CheckClientOptions(const ClientOptions& options) {
  if (options.servers.empty()) return absl::InvalidArgumentError("no servers given");
  // Each server holds its own share of a job: one listed twice would be
  // asked for two shares under one name.
  for (size_t i = 0; i < options.servers.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (options.servers[i] == options.servers[j]) {
        return absl::InvalidArgumentError(absl::StrCat("server ", options.servers[i], " is listed twice (", j, " and ",
                                                       i, "); each server holds its own share of a job"));
      }
    }
  }
  return CheckTlsPem(options.tls_root_certs, options.tls_cert_chain, options.tls_private_key);
}

absl::Status CheckTlsPem(absl::string_view root_certs, absl::string_view cert_chain, absl::string_view private_key) {
  if (cert_chain.empty() != private_key.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("a client certificate needs its key and a key its certificate (",
                                                   cert_chain.empty() ? "the key" : "the certificate",
                                                   " is given alone)"));
  }
  return CheckTlsFiles(root_certs, cert_chain, private_key, {"the CA file", "the client certificate", "the client key"});
}

absl::StatusOr<std::string> CleanBearerToken(absl::string_view token) {
  token = absl::StripAsciiWhitespace(token);
  for (size_t i = 0; i < token.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(token[i]);
    if (c < 0x21 || c > 0x7e) {
      return absl::InvalidArgumentError(absl::StrCat("the token's character ", i + 1, " of ", token.size(),
                                                     " is not printable ASCII, which a header cannot carry"));
    }
  }
  return std::string(token);
}

absl::Status CheckJobOptions(const JobOptions& job, uint32_t rank) {
  if (job.name.empty()) return absl::InvalidArgumentError("a job needs a name");
  if (job.tensors.empty()) return absl::InvalidArgumentError(absl::StrCat("job '", job.name, "' has no tensors"));
  if (job.world_size == 0) return absl::InvalidArgumentError("world_size must be at least 1");
  if (rank >= job.world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " is out of range for world_size ", job.world_size));
  }
  if (job.grad_type != GradType::kBf16 && job.grad_type != GradType::kFp32) {
    return absl::InvalidArgumentError(absl::StrCat("no such grad_type (", static_cast<int>(job.grad_type), ")"));
  }
  for (const GroupOptions& g : job.groups) {
    if (g.precision != StatePrecision::kFp32 && g.precision != StatePrecision::kBf16) {
      return absl::InvalidArgumentError(absl::StrCat("group '", g.name, "' has no such state precision (",
                                                     static_cast<int>(g.precision), ")"));
    }
  }
  for (const TensorOptions& t : job.tensors) {
    if (t.param_type != ParamType::kBf16 && t.param_type != ParamType::kFp32) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "' has no such param_type (",
                                                     static_cast<int>(t.param_type), ")"));
    }
    if (t.numel == 0 || t.numel > kMaxNumel) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "' has numel ", t.numel,
                                                     "; it must be in [1, 2^40]"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckStepOptions(const StepOptions& options) {
  if (!(options.loss_scale > 0) || !std::isfinite(options.loss_scale)) {
    return absl::InvalidArgumentError(absl::StrCat("loss_scale must be finite and > 0, got ", options.loss_scale));
  }
  if (!(options.max_grad_norm >= 0) || !std::isfinite(options.max_grad_norm)) {
    return absl::InvalidArgumentError(absl::StrCat("max_grad_norm must be finite and >= 0 (0: no clipping), got ",
                                                   options.max_grad_norm));
  }
  return absl::OkStatus();
}

}  // namespace shardopt
