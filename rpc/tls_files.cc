#include "rpc/tls_files.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <ctime>
#include <memory>
#include <string>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

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

absl::Status CheckTlsFiles(absl::string_view ca, absl::string_view certificate, absl::string_view key,
                           const TlsFileNames& names) {
  const std::pair<absl::string_view, const char*> given[] = {
      {ca, names.ca}, {certificate, names.certificate}, {key, names.key}};
  for (const auto& [pem, what] : given) {
    if (!pem.empty() && !absl::StrContains(pem, "-----BEGIN ")) {
      return absl::InvalidArgumentError(absl::StrCat(what, " is not PEM text (no '-----BEGIN' line)"));
    }
  }
  if (!ca.empty() && FirstCertificate(ca) == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(names.ca, " holds no certificate OpenSSL can read (",
                                                   OpenSslReason(), ")"));
  }
  if (certificate.empty() && key.empty()) return absl::OkStatus();
  if (certificate.empty() || key.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(names.certificate, " and ", names.key, " go together"));
  }
  const auto leaf = FirstCertificate(certificate);
  if (leaf == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(names.certificate, " is not a certificate OpenSSL can read (",
                                                   OpenSslReason(), ")"));
  }
  const std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> private_key(
      PEM_read_bio_PrivateKey(ReadOnly(key).get(), nullptr, &NoPassphrase, nullptr), &EVP_PKEY_free);
  if (private_key == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        names.key, " is not a private key OpenSSL can read, or it is encrypted, which gRPC cannot use (",
        OpenSslReason(), ")"));
  }
  if (X509_check_private_key(leaf.get(), private_key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(
        absl::StrCat(names.key, " does not match ", names.certificate, " (the first in its file)"));
  }
  return absl::OkStatus();
}

absl::Status CheckCertificateDates(absl::string_view pem, absl::string_view what) {
  const auto leaf = FirstCertificate(pem);
  if (leaf == nullptr) return absl::OkStatus();  // CheckTlsFiles says why
  const auto when = [](const ASN1_TIME* t) {
    std::unique_ptr<BIO, decltype(&BIO_free)> out(BIO_new(BIO_s_mem()), &BIO_free);
    ASN1_TIME_print(out.get(), t);
    char* text = nullptr;
    const long n = BIO_get_mem_data(out.get(), &text);
    return std::string(text, static_cast<size_t>(n));
  };
  if (X509_cmp_current_time(X509_get0_notAfter(leaf.get())) < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, " expired on ", when(X509_get0_notAfter(leaf.get())), ": peers refuse it"));
  }
  if (X509_cmp_current_time(X509_get0_notBefore(leaf.get())) > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, " is not valid before ", when(X509_get0_notBefore(leaf.get())), ": peers refuse it"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> CertificateNotAfter(absl::string_view pem) {
  const auto leaf = FirstCertificate(pem);
  if (leaf == nullptr) return absl::InvalidArgumentError("no certificate OpenSSL can read");
  tm when{};
  if (ASN1_TIME_to_tm(X509_get0_notAfter(leaf.get()), &when) != 1) {
    return absl::InvalidArgumentError("the certificate's notAfter cannot be read");
  }
  return static_cast<int64_t>(timegm(&when));
}

}  // namespace shardopt
