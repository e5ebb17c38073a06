// The TLS files a server or a client is given, read with OpenSSL before gRPC
// gets them: gRPC finds a bad one only at the first handshake (a client's
// calls then fail as UNAVAILABLE, as if the server were down) or when the
// server starts listening (which it then reports as a port it cannot
// listen on).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardopt {

// What to call each file in a message: "the client key", "--tls_key".
struct TlsFileNames {
  const char* ca;
  const char* certificate;
  const char* key;
};

// Each file given (empty: not given) must be PEM text that OpenSSL reads:
// a certificate in the CA file and in the certificate's, an unencrypted
// private key (gRPC cannot ask for a passphrase), and that key the first
// certificate's (its file's leaf). A certificate and a key come together.
// INVALID_ARGUMENT naming the file otherwise.
absl::Status CheckTlsFiles(absl::string_view ca, absl::string_view certificate, absl::string_view key,
                           const TlsFileNames& names);

// FAILED_PRECONDITION naming `what` and the date if the first certificate of
// `pem` (a chain's leaf, read as CheckTlsFiles reads it) has expired or is
// not valid yet: every peer would refuse the handshake, with nothing said
// on this side.
absl::Status CheckCertificateDates(absl::string_view pem, absl::string_view what);

// When the first certificate of `pem` expires, in seconds since the Unix
// epoch; INVALID_ARGUMENT if there is none OpenSSL can read.
absl::StatusOr<int64_t> CertificateNotAfter(absl::string_view pem);

}  // namespace shardopt
