#include "client/option_checks.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <cmath>
#include <memory>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "rpc/job_limits.h"

namespace shardopt {
namespace {

// OpenSSL's reason for its last failure, its queue left empty.
std::string OpenSslReason() {
  const unsigned long error = ERR_get_error();
  ERR_clear_error();
  if (error == 0) return "no reason given";
  char text[256];
  ERR_error_string_n(error, text, sizeof text);
  return text;
}

std::unique_ptr<BIO, decltype(&BIO_free)> ReadOnly(absl::string_view pem) {
  return {BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())), &BIO_free};
}

// The first certificate of PEM text (a chain's leaf), or null.
std::unique_ptr<X509, decltype(&X509_free)> FirstCertificate(absl::string_view pem) {
  return {PEM_read_bio_X509(ReadOnly(pem).get(), nullptr, nullptr, nullptr), &X509_free};
}

// Never asks for a passphrase: OpenSSL's default would read the terminal.
int NoPassphrase(char*, int, int, void*) { return 0; }

}  // namespace

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
  const std::pair<absl::string_view, const char*> given[] = {
      {root_certs, "the CA file"}, {cert_chain, "the client certificate"}, {private_key, "the client key"}};
  for (const auto& [pem, what] : given) {
    if (!pem.empty() && !absl::StrContains(pem, "-----BEGIN ")) {
      return absl::InvalidArgumentError(absl::StrCat(what, " is not PEM text (no '-----BEGIN' line)"));
    }
  }
  // What gRPC would find only at the first handshake, each call then failing
  // as UNAVAILABLE.
  if (!root_certs.empty() && FirstCertificate(root_certs) == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("the CA file holds no certificate OpenSSL can read (",
                                                   OpenSslReason(), ")"));
  }
  if (cert_chain.empty()) return absl::OkStatus();
  const auto certificate = FirstCertificate(cert_chain);
  if (certificate == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("the client certificate is not a certificate OpenSSL can read (",
                                                   OpenSslReason(), ")"));
  }
  const std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(
      PEM_read_bio_PrivateKey(ReadOnly(private_key).get(), nullptr, &NoPassphrase, nullptr), &EVP_PKEY_free);
  if (key == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the client key is not a private key OpenSSL can read, or it is encrypted, which gRPC cannot use (",
        OpenSslReason(), ")"));
  }
  if (X509_check_private_key(certificate.get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError("the client key does not match the client certificate (the first in its file)");
  }
  return absl::OkStatus();
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
