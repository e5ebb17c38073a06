// The files the server reads at start and again when they change: the
// tokens file and the TLS files, which a Kubernetes Secret's update
// replaces in place (a new file behind the same path) without a signal.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace shardopt {

// What tells a file's versions apart: its inode, size and modification
// time, as stat sees them through any symlinks; empty if it cannot be read.
std::string FileIdentity(const std::string& path);

// The server's TLS files as its flags name them; empty: not given.
struct TlsFiles {
  std::string client_ca, cert, key;
};

// Their PEM text, each read whole and checked with OpenSSL as gRPC would
// use it (rpc/tls_files.h): FAILED_PRECONDITION or INVALID_ARGUMENT naming
// the flag, where gRPC would only fail to listen, or fail each handshake.
absl::StatusOr<TlsFiles> ReadTlsFiles(const TlsFiles& paths);

// Sets the metric shardopt_tls_certificate_expiry_timestamp_seconds to when
// `cert_pem`'s first certificate, the one new connections get, expires.
void ExportCertificateExpiry(const std::string& cert_pem);

// The three files' FileIdentity together; never empty.
std::string TlsFilesIdentity(const TlsFiles& paths);

class TlsCopies;

// Notices a change of the TLS files and checks it as at start: usable files
// go into `copies`, which gRPC reads again by itself for new connections
// (ServerOptions::tls_reload_seconds), and are logged as tls_reload; files
// that are not are logged at error level and leave the copies as they were,
// and are checked again every reload_seconds until usable (a certificate
// not valid yet becomes so, and the files need not change again).
class TlsFilesWatch {
 public:
  // `seen`: TlsFilesIdentity(paths) before the files in use were read, so
  // that a change while they were is noticed. Inert without a certificate
  // or with reload_seconds 0 (then `copies` may be null); else `copies`
  // outlives the watch.
  TlsFilesWatch(TlsFiles paths, unsigned reload_seconds, TlsCopies* copies, std::string seen);
  // Called about once a second from the server's main loop.
  void Poll();

 private:
  const TlsFiles paths_;
  const unsigned reload_seconds_;
  TlsCopies* const copies_;
  std::string seen_;  // empty: inert
  bool unusable_ = false;  // the files seen_ names were not taken
  absl::Time check_again_;
};

}  // namespace shardopt
