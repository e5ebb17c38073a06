#include "client/option_checks.h"

#include <cmath>
#include <memory>
#include <utility>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_split.h"
#include "base/status_macros.h"
#include "google/protobuf/stubs/common.h"
#include "rpc/bearer_token.h"
#include "rpc/job_limits.h"
#include "rpc/learning_rates.h"
#include "rpc/tensor_shapes.h"
#include "rpc/tls_files.h"

namespace shardopt {

namespace {

// The schemes gRPC 1.51's resolvers take, in the case they are looked up in.
constexpr absl::string_view kSchemes[] = {"dns", "unix", "unix-abstract", "ipv4", "ipv6", "xds", "google-c2p"};

// Whether `address` is host:port, or [address]:port for IPv6, the port a
// number from 1 to 65535 (0 is no port a server listens on).
bool IsHostPort(absl::string_view address) {
  const size_t last = address.rfind(':');
  if (last == absl::string_view::npos) return false;
  const absl::string_view host = address.substr(0, last), port = address.substr(last + 1);
  // An IPv6 address is bracketed, so that its own colons are not the port's.
  const bool host_ok = !host.empty() && (host.find(':') == absl::string_view::npos ||
                                         (host.front() == '[' && host.back() == ']'));
  if (!host_ok || port.empty() || port.size() > 5 || !absl::c_all_of(port, absl::ascii_isdigit)) return false;
  const int number = std::stoi(std::string(port));
  return number >= 1 && number <= 65535;
}

}  // namespace

absl::Status CheckServerAddress(const std::string& address) {
  // Any name before a colon was taken for a scheme before, so that a port
  // mistyped (host:50o51) connected, and every call was UNAVAILABLE from a
  // name that does not resolve, "safe to retry"; and a scheme's own port
  // went unchecked (ipv4:127.0.0.1:50o51 dialed port 50).
  const size_t first = address.find(':');
  const std::string scheme = first == std::string::npos ? "" : address.substr(0, first);
  if (!scheme.empty() && first + 1 < address.size() && absl::c_linear_search(kSchemes, scheme)) {
    absl::string_view rest = absl::string_view(address).substr(first + 1);
    if (scheme == "dns") {  // dns:[//authority/]host:port
      if (absl::ConsumePrefix(&rest, "//")) rest = rest.substr(std::min(rest.size(), rest.find('/') + 1));
      if (IsHostPort(rest)) return absl::OkStatus();
    } else if (scheme == "ipv4" || scheme == "ipv6") {  // a list of address:port
      if (absl::c_all_of(absl::StrSplit(rest, ','), IsHostPort)) return absl::OkStatus();
    } else {
      return absl::OkStatus();  // a path, or a name without a port
    }
    return absl::InvalidArgumentError(absl::StrCat("server '", address, "' names no port, or one that is not a "
                                                   "number from 1 to 65535, after its scheme"));
  }
  if (!IsHostPort(address)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "server '", address, "' is not host:port ([address]:port for IPv6, the port a number from 1 to 65535), nor a "
        "gRPC target with a scheme in lower case (", absl::StrJoin(kSchemes, ":, "), ":)"));
  }
  return absl::OkStatus();
}

absl::Status CheckClientOptions(const ClientOptions& options) {
  if (options.servers.empty()) return absl::InvalidArgumentError("no servers given");
  for (const std::string& address : options.servers) SHARDOPT_RETURN_IF_ERROR(CheckServerAddress(address));
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
  // A node group's rank pushes its part to each of its servers once.
  for (size_t i = 0; i < options.push_servers.size(); ++i) {
    const uint32_t s = options.push_servers[i];
    if (s >= options.servers.size()) {
      return absl::InvalidArgumentError(absl::StrCat("push_servers names server ", s, " of ", options.servers.size()));
    }
    for (size_t j = 0; j < i; ++j) {
      if (options.push_servers[j] == s) {
        return absl::InvalidArgumentError(absl::StrCat("push_servers names server ", s, " twice"));
      }
    }
  }
  if (options.max_attempts < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_attempts must be at least 1 (1: no retry), got ", options.max_attempts));
  }
  // A deadline of 0 would fail every call at once, as DEADLINE_EXCEEDED.
  if (options.rpc_timeout_ms == 0) return absl::InvalidArgumentError("rpc_timeout_ms must be at least 1");
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

absl::StatusOr<std::string> CleanBearerToken(absl::string_view given) {
  const absl::string_view token = absl::StripAsciiWhitespace(given);
  if (token.empty() && !given.empty()) {
    // A mistake (an empty Secret), not a wish to call without a token.
    return absl::InvalidArgumentError("the token is only whitespace; to call without a token, give none");
  }
  for (size_t i = 0; i < token.size(); ++i) {
    if (SendableTokenByte(token[i])) continue;
    const char c = token[i];
    return absl::InvalidArgumentError(absl::StrCat(
        "the token's character ", i + 1, " is ",
        c == ' '                ? "a space: a token is one word (give it without 'Bearer ')"
        : c == '\n' || c == '\r' ? "a line break: give one token, on one line"
                                : "not printable ASCII, which a header cannot carry"));
  }
  return std::string(token);
}

absl::Status CheckNameIsUtf8(absl::string_view what, absl::string_view name) {
  // The very check protobuf's parser makes of a string field.
  if (google::protobuf::internal::IsStructurallyValidUTF8(name.data(), static_cast<int>(name.size()))) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat(what, " '", absl::CHexEscape(name), "' is not UTF-8, which names must be"));
}

absl::Status CheckJobOptions(const JobOptions& job, uint32_t rank) {
  if (job.resume != Resume::kEither && job.resume != Resume::kNew && job.resume != Resume::kOnly) {
    return absl::InvalidArgumentError(absl::StrCat("JobOptions::resume has no such value (", static_cast<int>(job.resume), ")"));
  }
  // A restore at a step is a resume: refused only after it had moved the
  // newer checkpoints aside.
  if (job.resume == Resume::kNew && job.restore_step != 0) {
    return absl::InvalidArgumentError(absl::StrCat("restore_step ", job.restore_step, " resumes the job, and resume is "
                                                   "new (kNew, Python resume=False): give one or the other"));
  }
  if (job.name.empty()) return absl::InvalidArgumentError("a job needs a name");
  SHARDOPT_RETURN_IF_ERROR(CheckNameIsUtf8("job name", job.name));
  for (const GroupOptions& g : job.groups) SHARDOPT_RETURN_IF_ERROR(CheckNameIsUtf8("group name", g.name));
  for (const TensorOptions& t : job.tensors) SHARDOPT_RETURN_IF_ERROR(CheckNameIsUtf8("tensor name", t.name));
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
    if (!ShapeFits(t.shape, t.numel)) return absl::InvalidArgumentError(ShapeRefusal(t.name, t.shape, t.numel));
  }
  return absl::OkStatus();
}

absl::Status CheckStepOptions(const StepOptions& options, uint64_t ranks) {
  if (!(options.loss_scale > 0) || !std::isfinite(options.loss_scale)) {
    return absl::InvalidArgumentError(absl::StrCat("loss_scale must be finite and > 0, got ", options.loss_scale));
  }
  // Decide's gscale, 1 / (loss_scale x ranks) at most, goes to the servers
  // as a float, which the servers refuse when it is infinite: only at the
  // commit, after the push.
  if (!std::isfinite(static_cast<float>(1.0 / (options.loss_scale * static_cast<double>(ranks))))) {
    return absl::InvalidArgumentError(absl::StrCat("loss_scale ", options.loss_scale, " over ", ranks,
                                                   " rank(s) is too small: 1 / (loss_scale x ranks) must be a finite "
                                                   "float (loss_scale x ranks of 2.938736e-39 or more: 1 / FLT_MAX, rounded up)"));
  }
  if (!(options.max_grad_norm >= 0) || !std::isfinite(options.max_grad_norm)) {
    return absl::InvalidArgumentError(absl::StrCat("max_grad_norm must be finite and >= 0 (0: no clipping), got ",
                                                   options.max_grad_norm));
  }
  return absl::OkStatus();
}

absl::Status CheckJobLearningRates(const JobOptions& job, double lr, absl::Span<const double> group_lr) {
  std::vector<AdamWHyper> groups;
  for (const GroupOptions& g : job.groups) {
    groups.push_back({g.beta1, g.beta2, g.eps, g.weight_decay, g.lr_multiplier == 0 ? 1.0 : g.lr_multiplier});
  }
  return CheckLearningRates(lr, group_lr, groups, job.name);
}

}  // namespace shardopt
