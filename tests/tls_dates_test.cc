// A certificate out of its dates is named, with the date, where gRPC would
// only fail every handshake (the server logs it at start, and a renewal to
// such a file is not taken: TlsFilesWatch).
#include <openssl/ec.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <ctime>
#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "rpc/tls_files.h"

namespace shardopt {
namespace {

// A self-signed certificate valid from `from` to `to` seconds from now, as PEM.
std::string Certificate(long from, long to) {
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> key(EVP_EC_gen("P-256"), &EVP_PKEY_free);
  std::unique_ptr<X509, decltype(&X509_free)> cert(X509_new(), &X509_free);
  X509_set_version(cert.get(), 2);
  ASN1_INTEGER_set(X509_get_serialNumber(cert.get()), 1);
  X509_gmtime_adj(X509_getm_notBefore(cert.get()), from);
  X509_gmtime_adj(X509_getm_notAfter(cert.get()), to);
  X509_NAME_add_entry_by_txt(X509_get_subject_name(cert.get()), "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>("dates"), -1, -1, 0);
  X509_set_issuer_name(cert.get(), X509_get_subject_name(cert.get()));
  X509_set_pubkey(cert.get(), key.get());
  X509_sign(cert.get(), key.get(), EVP_sha256());
  std::unique_ptr<BIO, decltype(&BIO_free)> out(BIO_new(BIO_s_mem()), &BIO_free);
  PEM_write_bio_X509(out.get(), cert.get());
  char* text = nullptr;
  const long n = BIO_get_mem_data(out.get(), &text);
  return std::string(text, static_cast<size_t>(n));
}

TEST(TlsDatesTest, AnExpiredOrNotYetValidCertificateIsNamedWithItsDate) {
  EXPECT_TRUE(CheckCertificateDates(Certificate(-3600, 3600), "--tls_cert").ok());
  const absl::Status expired = CheckCertificateDates(Certificate(-7200, -3600), "--tls_cert");
  EXPECT_EQ(expired.code(), absl::StatusCode::kFailedPrecondition) << expired;
  EXPECT_THAT(std::string(expired.message()), ::testing::MatchesRegex("--tls_cert expired on .* GMT: peers refuse it"));
  const absl::Status early = CheckCertificateDates(Certificate(3600, 7200), "--tls_cert");
  EXPECT_EQ(early.code(), absl::StatusCode::kFailedPrecondition) << early;
  EXPECT_THAT(std::string(early.message()), ::testing::HasSubstr("--tls_cert is not valid before "));
}

// The metric shardopt_tls_certificate_expiry_timestamp_seconds, to the second.
TEST(TlsDatesTest, TheExpiryIsTheCertificatesNotAfter) {
  const int64_t now = static_cast<int64_t>(std::time(nullptr));
  const absl::StatusOr<int64_t> expires = CertificateNotAfter(Certificate(-60, 86400));
  ASSERT_TRUE(expires.ok()) << expires.status();
  EXPECT_GE(*expires, now + 86400);
  EXPECT_LE(*expires, now + 86400 + 5);
  EXPECT_EQ(CertificateNotAfter("no certificate").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shardopt
